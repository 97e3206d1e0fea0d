"""StatePool: the recurrent states of a model's live streams, one slot per stream, in the engine's memory.

A stateful stream's state (h and c of every layer and direction of every block) lives
in a slot of its model's pool between chunks: on the GPU engine in device memory, as
one array per block and state kind, ``[rows, slots, width]`` (sequence-major, the
layout cuDNN reads and writes ``hx``/``hy`` in). A batch that holds stream chunks says
which of its rows continue a stream (read their initial state from a slot) and which
rows' final states go back to a slot (:class:`PooledRows`); the engine then moves all
of them with one gather and one scatter per array, however many streams the batch
holds. Keeping a separate small array per stream instead cost Python work per chunk
on every batch (pointer lists, slicing the final states apart): profiled on an H100
host under 256 paced streams, a quarter of the engine process's one core.

Slots are handed out on the event loop (:meth:`StatePool.acquire` / :meth:`release`,
plain integers) and the arrays grow (doubling, up to ``max_slots``) only where the
engine uses them (:meth:`StatePool.reserve`, under the engine's lock and on its device
stream), so a slot taken while a batch runs never races with that batch.

The arrays start with room for every stream the model allows (``max_streams``) when that
takes at most :data:`PRESIZE_BYTES`, as it does for usual stream models (2 layers, H=256,
float32: 4 KiB a stream, 4 MiB for the default 1024 streams). Growing moves the arrays, and
the GPU engine's fused stream graphs are captured over their addresses: every growth made
the engine capture each batch size's graph again, 10-20 ms apiece on its one thread, and
the chunks waiting meanwhile made the tail (H100 host, 256 paced streams starting together:
21-28 captures inside a 6 s measurement, p99 33-61 ms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import Unavailable
from ..spec import RNNSpec

_INITIAL_SLOTS = 16
PRESIZE_BYTES = 32 * 2**20  # a pool starts this large at most (see the module's docstring)


class StatePool:
    """Per-block state arrays ``[rows, capacity, width]`` in array module ``xp`` and ``dtype``, and their slots."""

    def __init__(self, spec: RNNSpec, xp: Any, dtype: Any, max_slots: int, initial: int | None = None) -> None:
        """``initial``: slots to start with (default: ``max_slots`` if they fit in :data:`PRESIZE_BYTES`,
        else as many as fit, at least 16)."""
        if max_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got max_slots={max_slots}")
        self.spec = spec
        self.max_slots = int(max_slots)
        self._xp = xp
        self._dtype = np.dtype(dtype)
        if initial is None:
            initial = max(_INITIAL_SLOTS, PRESIZE_BYTES // max(1, self.slot_bytes(spec, self._dtype)))
        self.capacity = min(int(initial), self.max_slots)
        self.arrays: list[tuple[Any, Any]] = [
            (self._zeros(blk.pseudo_layers, self.capacity, blk.output_size),
             self._zeros(blk.pseudo_layers, self.capacity, blk.hidden_size) if blk.cell == "lstm" else None)
            for blk in spec.blocks]
        self._free: list[int] = []
        self._top = 0  # slots [0, _top) have been handed out at least once

    @staticmethod
    def slot_bytes(spec: RNNSpec, dtype: Any) -> int:
        """Bytes one stream's state takes (h, and c for LSTM blocks, of every layer and direction)."""
        per = sum(blk.pseudo_layers * (blk.output_size + (blk.hidden_size if blk.cell == "lstm" else 0))
                  for blk in spec.blocks)
        return per * np.dtype(dtype).itemsize

    def _zeros(self, rows: int, slots: int, width: int) -> Any:
        return self._xp.zeros((rows, slots, width), self._dtype)

    @property
    def free(self) -> int:
        """Slots :meth:`acquire` can still hand out."""
        return len(self._free) + self.max_slots - self._top

    @property
    def in_use(self) -> int:
        """Slots held by live streams."""
        return self._top - len(self._free)

    def acquire(self) -> int:
        """A free slot (its contents are stale until a chunk writes it); Unavailable when all are held."""
        if self._free:
            return self._free.pop()
        if self._top >= self.max_slots:
            raise Unavailable(f"all {self.max_slots} stream state slots are in use; end finished streams with "
                              f"sequence_end or raise max_streams")
        self._top += 1
        return self._top - 1

    def release(self, slot: int) -> None:
        """Give ``slot`` back (its stream ended and has no chunk in flight)."""
        self._free.append(slot)

    def reserve(self) -> None:
        """Grow the arrays to hold every slot handed out so far (call where the engine runs its batches)."""
        needed = self._top
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_slots)
        grown = []
        for h, c in self.arrays:
            pair = []
            for a in (h, c):
                if a is None:
                    pair.append(None)
                    continue
                bigger = self._zeros(a.shape[0], capacity, a.shape[2])
                bigger[:, :self.capacity] = a
                pair.append(bigger)
            grown.append((pair[0], pair[1]))
        self.arrays, self.capacity = grown, capacity


@dataclass(frozen=True)
class PooledRows:
    """The stream rows of one batch of ``rows`` sequences: where each starts from and where its final state goes.

    ``index`` is one int32 array ``[2, rows]``: ``index[0, b]`` the slot row ``b`` reads its
    initial state from (-1: none, it starts from its own h_0/c_0 or zeros), ``index[1, b]``
    the slot its final state goes to (-1: none). One array, so the GPU engine uploads it with
    the batch's inputs and each block's gather and scatter is one kernel reading it.
    """

    pool: StatePool
    index: np.ndarray
    reads: int

    @classmethod
    def of(cls, pool: StatePool, rows: int, reads: list[tuple[int, int]], writes: list[tuple[int, int]]
           ) -> "PooledRows":
        """From (slot, row) reads and (row, slot) writes in a batch of ``rows``."""
        index = np.full((2, rows), -1, dtype=np.int32)
        for slot, row in reads:
            index[0, row] = slot
        for row, slot in writes:
            index[1, row] = slot
        return cls(pool, index, len(reads))

    def read_pairs(self) -> np.ndarray:
        """[reads, 2] (slot, row)."""
        rows = np.flatnonzero(self.index[0] >= 0)
        return np.stack([self.index[0, rows], rows], axis=1)

    def write_pairs(self) -> np.ndarray:
        """[writes, 2] (row, slot)."""
        rows = np.flatnonzero(self.index[1] >= 0)
        return np.stack([rows, self.index[1, rows]], axis=1)
