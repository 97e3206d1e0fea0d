"""Batches gathered from device-mapped front-end arenas (service.engines.cudnn.mapped, .host_rows) and the
announcements that drive the mapping (service.engines.shared_host), with a stand-in for CuPy's runtime.

The row table is checked by reading the memory it points at, as the gather kernel does on the GPU: it must
describe exactly the batch ``merge`` builds on the host (the kernel itself runs under ``pytest -m gpu``).
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np
import pytest

from service.engines import shared_host
from service.engines.cudnn.host_rows import HostRows, host_rows
from service.engines.cudnn.mapped import MappedHost
from service.scheduler import SequenceWork
from service.scheduler.batching import merge

OFFSET = 1 << 40  # the stand-in's device addresses: host address + OFFSET


class FakeRuntime:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple] = []

    def hostRegister(self, ptr, size, flags):  # noqa: N802 - CuPy's names
        if self.refuse:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.calls.append(("register", ptr, size, flags, self.device))

    def pointerGetAttributes(self, ptr):  # noqa: N802
        return type("Attributes", (), {"devicePointer": ptr + OFFSET})()

    def hostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr, self.device))

    def deviceSynchronize(self):  # noqa: N802
        self.calls.append(("synchronize", self.device))


class FakeCupy:
    def __init__(self, refuse: bool = False) -> None:
        runtime = FakeRuntime(refuse)
        runtime.device = None

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                runtime.device = self.index

            def __exit__(self, *exc):
                runtime.device = None

        self.cuda = type("Cuda", (), {"runtime": runtime, "Device": Device})()


def _address(buffer) -> int:
    return np.frombuffer(buffer, np.uint8).ctypes.data


def test_a_range_is_mapped_looked_up_and_unmapped_after_its_devices_finish():
    cp = FakeCupy()
    mapped = MappedHost(cp, device=2)
    buf = mmap.mmap(-1, 1 << 16)
    start = _address(buf)
    assert mapped.add("arena-a", buf)
    assert mapped.add("arena-a", buf)  # seen twice (announced while the watch began): registered once
    assert cp.cuda.runtime.calls == [("register", start, 1 << 16, 0x03, 2)]  # portable and mapped, on its device
    assert mapped.device_address(start + 100, 50, device=1) == start + 100 + OFFSET
    assert mapped.device_address(start + (1 << 16) - 8, 16, device=1) is None  # runs past the range
    assert mapped.device_address(start - 64, 8, device=1) is None
    mapped.remove("arena-a")
    assert cp.cuda.runtime.calls[1:] == [("synchronize", 1), ("unregister", start, 2)]  # device 1 read it
    assert len(mapped) == 0 and mapped.device_address(start + 100, 50, device=1) is None
    mapped.remove("arena-a")  # twice: nothing more
    assert len(cp.cuda.runtime.calls) == 3


def test_a_range_the_driver_refuses_stays_unmapped(caplog):
    mapped = MappedHost(FakeCupy(refuse=True))
    buf = mmap.mmap(-1, 4096)
    with caplog.at_level(logging.WARNING):
        assert not mapped.add("arena-b", buf)
    assert "merge on the host" in caplog.text
    assert mapped.device_address(_address(buf), 16, device=0) is None


def test_announced_buffers_reach_watchers_present_and_future_and_a_failing_watcher_is_contained(caplog, monkeypatch):
    monkeypatch.setattr(shared_host, "_watchers", [])  # this test's watchers only, gone after it
    seen: list[tuple] = []

    def on_add(key, buffer):
        seen.append(("add", key))

    def on_remove(key):
        seen.append(("remove", key))

    def broken(key, buffer):
        raise RuntimeError("no device")

    shared_host.announce("early", bytearray(8))
    shared_host.watch(on_add, on_remove)
    shared_host.watch(broken, on_remove)
    with caplog.at_level(logging.ERROR):
        shared_host.announce("late", bytearray(8))
    shared_host.withdraw("early")
    shared_host.withdraw("early")  # unknown now: no call
    shared_host.withdraw("late")
    assert seen == [("add", "early"), ("add", "late"), ("remove", "early"), ("remove", "early"),
                    ("remove", "late"), ("remove", "late")]
    assert "watcher failed on late" in caplog.text


def _read_rows(rows: HostRows) -> np.ndarray:
    """What the gather kernel writes: each row's valid bytes from its address, zeros after."""
    n, t, f = rows.shape
    row_bytes = t * f * rows.dtype.itemsize
    out = np.zeros(n * row_bytes, np.uint8)
    for b, (address, valid) in enumerate(rows.table.T):
        assert address % rows.unit == 0 and valid % rows.unit == 0 and row_bytes % rows.unit == 0
        out[b * row_bytes:b * row_bytes + valid] = np.frombuffer(ctypes.string_at(int(address) - OFFSET, int(valid)),
                                                                 np.uint8)
    return out.view(rows.dtype).reshape(rows.shape)


@pytest.fixture()
def arena():
    cp = FakeCupy()
    mapped = MappedHost(cp)
    buf = mmap.mmap(-1, 1 << 20)
    mapped.add("arena", buf)
    yield mapped, buf
    mapped.remove("arena")


def _parts_in(buf, rng, sizes, feat=7, dtype=np.float32):
    """Parts as a front-end's lane sends them (several requests merged, padded to their longest), placed in ``buf``."""
    parts, offset = [], 0
    for lens in sizes:
        t = max(lens)
        x = np.ndarray((len(lens), t, feat), dtype, buffer=buf, offset=offset)
        x[...] = rng.standard_normal(x.shape)
        for row, n in enumerate(lens):
            x[row, n:] = 0
        offset += (x.nbytes + 63) // 64 * 64
        parts.append(SequenceWork(x, np.array(lens), outputs=frozenset({"output_last"})))
    return parts


def test_the_row_table_describes_exactly_the_batch_merge_builds(arena):
    mapped, buf = arena
    rng = np.random.default_rng(0)
    parts = _parts_in(buf, rng, [[5, 17, 3], [1], [11, 11], [17, 2, 9, 4]])
    want = merge(parts)
    got = merge(parts, rows=lambda xs, t: host_rows(mapped, xs, t, np.dtype(np.float32), device=0))
    assert isinstance(got.x, HostRows) and got.x.shape == want.x.shape == (10, 17, 7)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_array_equal(_read_rows(got.x), want.x)
    assert got.x.unit == 4  # 7 features x 4 bytes: rows of 28-byte steps
    assert all(any(x is s for s in got.x.sources) for x in (p.x for p in parts))  # kept alive with the batch
    alone = merge(parts[:1], rows=lambda xs, t: host_rows(mapped, xs, t, np.dtype(np.float32), device=0))
    assert alone.x is parts[0].x  # one part, nothing to merge: it goes as it is


def test_a_longer_part_is_cut_to_the_batch_and_aligned_rows_copy_sixteen_bytes_at_a_time(arena):
    mapped, buf = arena
    rng = np.random.default_rng(1)
    parts = _parts_in(buf, rng, [[3, 8], [6]], feat=8)
    parts[0] = SequenceWork(parts[0].x, np.array([3, 5]), outputs=parts[0].outputs)  # x holds 8 steps, valid 5
    got = host_rows(mapped, [p.x for p in parts], 6, np.dtype(np.float32), device=0)
    assert got.unit == 16
    np.testing.assert_array_equal(_read_rows(got), merge(parts).x)


def test_rows_outside_a_mapped_range_or_of_another_dtype_are_merged_on_the_host(arena):
    mapped, buf = arena
    rng = np.random.default_rng(2)
    parts = _parts_in(buf, rng, [[4, 2], [3]])
    elsewhere = rng.standard_normal((1, 4, 7)).astype(np.float32)
    assert host_rows(mapped, [parts[0].x, elsewhere], 4, np.dtype(np.float32), 0) is None
    halves = _parts_in(buf, rng, [[4]], dtype=np.float16)
    assert host_rows(mapped, [parts[0].x, halves[0].x], 4, np.dtype(np.float32), 0) is None
    merged = merge(parts + [SequenceWork(elsewhere, np.array([4]))],
                   rows=lambda xs, t: host_rows(mapped, xs, t, np.dtype(np.float32), 0))
    assert isinstance(merged.x, np.ndarray) and merged.x.shape == (4, 4, 7)
