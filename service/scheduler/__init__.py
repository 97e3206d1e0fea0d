"""Dynamic batching of ragged sequences: :class:`Scheduler` (policy) and :mod:`.batching` (merge/split)."""
from .batching import OUTPUT_NAMES, MergedBatch, SequenceWork, merge, output_last, split
from .memory_budget import MemoryBudget
from .scheduler import Scheduler
from .streams import StreamState, StreamStore

__all__ = ["Scheduler", "MemoryBudget", "StreamStore", "StreamState", "SequenceWork", "MergedBatch", "merge", "split", "output_last", "OUTPUT_NAMES"]
