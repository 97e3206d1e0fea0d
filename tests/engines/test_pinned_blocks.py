"""The GPU engine's pinned host blocks (service.engines.cudnn.pinned) with stand-ins for CuPy's memory and events."""
from __future__ import annotations

import numpy as np

from service.engines.cudnn.pinned import KEEP_IDLE, MIN_BLOCK, PinnedBlocks


class FakeEvent:
    def __init__(self) -> None:
        self.done = True
        self.streams = []

    def record(self, stream) -> None:
        self.done = False  # a copy is queued: not done until the test says so
        self.streams.append(stream)


def make_pool():
    events = []

    def new_event():
        events.append(FakeEvent())
        return events[-1]

    return PinnedBlocks(bytearray, new_event), events


def test_a_block_is_not_reused_while_a_view_of_it_lives():
    pool, _ = make_pool()
    a = pool.array((4, 5, 3), np.float32)
    a[:] = 1.0
    view = a[1:]
    del a
    b = pool.array((4, 5, 3), np.float32)
    assert pool.allocations == 2 and not np.shares_memory(view, b)
    del view
    pool.array((2, 2), np.float32)
    assert pool.allocations == 2  # the first block is free again


def test_a_block_is_not_reused_before_its_copy_has_finished():
    pool, events = make_pool()
    a = pool.array((8,), np.float32)
    blk = pool.owner(a)
    assert blk is not None and pool.owner(np.zeros(8, np.float32)) is None
    pool.copied(blk, "stream-1")
    del a
    b = pool.array((8,), np.float32)
    assert pool.allocations == 2 and events[0].streams == ["stream-1"]
    del b
    events[0].done = True
    pool.array((8,), np.float32)
    assert pool.allocations == 2


def test_blocks_are_sized_in_powers_of_two_and_idle_ones_are_trimmed():
    pool, _ = make_pool()
    small = pool.block(10)
    assert small.nbytes == MIN_BLOCK
    assert pool.block(MIN_BLOCK + 1).nbytes == 2 * MIN_BLOCK
    held = [pool.array((MIN_BLOCK // 4,), np.float32) for _ in range(KEEP_IDLE + 3)]
    assert len(pool) >= KEEP_IDLE + 3
    del held
    pool.block(64 * MIN_BLOCK)  # nothing fits: a new block, and the idle ones beyond KEEP_IDLE go
    assert len(pool) <= KEEP_IDLE
