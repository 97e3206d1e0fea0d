"""Pinned host blocks for host-to-device copies, reused once nothing can still read them.

Host inputs reach the GPU from page-locked memory: a merged batch is written straight
into a block (:meth:`PinnedBlocks.array`, what :meth:`CudnnEngine.input_buffer` lends the
scheduler), and small inputs (lengths, stream index, states) are packed into one. A block
can be written again once (a) no host array views it any more and (b) the copy queued
from it last has finished on the device. (a) is read from the reference count of the
block's memory, which every NumPy view over it holds, so a batch the scheduler still keeps
cannot be overwritten however long it lives; (b) from a CUDA event recorded after the copy.

Until this pool there was one staging buffer guarded by one event, so every launch waited
on the host (spinning) for the previous launch's copy, which is queued behind the previous
batch's compute when two batches are in flight, and every merged batch was built in
pageable memory and then copied a second time into the staging buffer.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_BLOCK = 1 << 16
KEEP_IDLE = 8  # blocks kept for reuse; more are freed (a burst of large batches does not pin memory for good)


@dataclass(eq=False)
class _Block:
    mem: Any              # the pinned allocation (CuPy PinnedMemoryPointer, or any buffer in tests)
    nbytes: int
    refs: int             # sys.getrefcount(mem) with no view alive
    event: Any = None     # recorded after the last copy out of this block


class PinnedBlocks:
    """A pool of pinned host blocks; ``alloc(nbytes)`` and ``new_event()`` come from CuPy (or a test)."""

    def __init__(self, alloc: Any, new_event: Any) -> None:
        self._alloc = alloc
        self._new_event = new_event
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()
        self.allocations = 0

    def block(self, nbytes: int) -> _Block:
        """A block of at least ``nbytes`` that nothing reads or copies from any more (new if none is free)."""
        with self._lock:
            best = None
            for blk in self._blocks:
                if blk.nbytes >= nbytes and self._free(blk) and (best is None or blk.nbytes < best.nbytes):
                    best = blk
            if best is not None:
                return best
            self._trim()
            size = max(MIN_BLOCK, 1 << (max(1, nbytes) - 1).bit_length())
            blk = _Block(self._alloc(size), size, 0)
            blk.refs = sys.getrefcount(blk.mem)  # no local name holds it: the count with no view alive
            self._blocks.append(blk)
            self.allocations += 1
            return blk

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialized host array in a free block; the block stays taken while any view of it lives."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        blk = self.block(count * dtype.itemsize)
        return np.frombuffer(blk.mem, dtype=dtype, count=count).reshape(shape)

    def owner(self, arr: np.ndarray) -> _Block | None:
        """The block ``arr``'s memory lies in (for a copy straight out of it), or None."""
        ptr, end = arr.ctypes.data, arr.ctypes.data + arr.nbytes
        with self._lock:
            for blk in self._blocks:
                start = _address(blk.mem)
                if start <= ptr and end <= start + blk.nbytes:
                    return blk
        return None

    def copied(self, blk: _Block, stream: Any) -> None:
        """A copy out of ``blk`` was queued on ``stream``: the block is not written again before it ends."""
        if blk.event is None:
            blk.event = self._new_event()
        blk.event.record(stream)

    @staticmethod
    def _free(blk: _Block) -> bool:
        # getrefcount's own argument is one more reference than blk.refs counted at creation, in both calls
        return sys.getrefcount(blk.mem) <= blk.refs and (blk.event is None or blk.event.done)

    def _trim(self) -> None:
        idle = [b for b in self._blocks if self._free(b)]
        for blk in sorted(idle, key=lambda b: b.nbytes)[:max(0, len(idle) - KEEP_IDLE + 1)]:
            self._blocks.remove(blk)

    def __len__(self) -> int:
        return len(self._blocks)


def _address(mem: Any) -> int:
    ptr = getattr(mem, "ptr", None)
    if ptr is not None:
        return int(ptr)
    return np.frombuffer(mem, dtype=np.uint8).ctypes.data
