"""Batches gathered on the GPU from device-mapped front-end arenas (service.engines.cudnn.mapped, .host_rows and
copies.gather_rows): the kernel against NumPy for every copy width, and the cuDNN engine's results from gathered
batches against the same batches merged on the host (bit for bit) and the float64 reference engine.

GPU only (``pytest -m gpu``); the row table and the mapping's bookkeeping are tested on any machine in
test_host_rows.py.
"""
from __future__ import annotations

import itertools
import mmap

import numpy as np
import pytest

from service.engines import shared_host
from service.engines.cudnn.host_rows import HostRows, host_rows
from service.loaders.verify import ATOL, RTOL
from service.scheduler import SequenceWork
from service.scheduler.batching import finish_batch, launch_batch, merge
from test_cudnn_copies_gpu import cp  # noqa: F401 - the fixture (CuPy, or skip without a CUDA device)
from test_cudnn_gpu import make_torch, model_from_torch, reference_run

pytestmark = pytest.mark.gpu
_keys = itertools.count()


@pytest.fixture()
def announced():
    """A shared mapping announced as a front-end arena is (withdrawn afterwards)."""
    made = []

    def make(size: int = 1 << 20):
        key, buf = f"test-arena-{next(_keys)}", mmap.mmap(-1, size)
        shared_host.announce(key, buf)
        made.append(key)
        return key, buf

    yield make
    for key in made:
        shared_host.withdraw(key)


def _parts_in(buf, rng, sizes, feat, dtype=np.float32, outputs=("output", "output_last", "h_n", "c_n")):
    """Parts as a front-end's lane sends them (requests merged, padded to their longest), placed in ``buf``."""
    parts, offset = [], 0
    for lens in sizes:
        x = np.ndarray((len(lens), max(lens), feat), dtype, buffer=buf, offset=offset)
        x[...] = rng.standard_normal(x.shape)
        for row, n in enumerate(lens):
            x[row, n:] = 0
        offset += (x.nbytes + 63) // 64 * 64
        parts.append(SequenceWork(x, np.array(lens), outputs=frozenset(outputs)))
    return parts


@pytest.mark.parametrize("feat,t_max,dtype,unit", [(8, 9, np.float32, 16), (2, 5, np.float32, 8),
                                                   (7, 5, np.float32, 4), (7, 5, np.float16, 2),
                                                   (5, 3, np.uint8, 1)])
def test_gather_rows_equals_the_host_merge_for_every_copy_width(cp, announced, feat, t_max, dtype, unit):
    from service.engines.cudnn.copies import gather_rows
    from service.engines.cudnn.mapped import mapped_host

    mapped = mapped_host(cp)
    _, buf = announced()
    rng = np.random.default_rng(unit)
    parts = _parts_in(buf, rng, [[t_max, 1], [2], [t_max - 1, t_max, 1]], feat, dtype)
    rows = host_rows(mapped, [p.x for p in parts], t_max, np.dtype(dtype), cp.cuda.runtime.getDevice())
    assert isinstance(rows, HostRows) and rows.unit == unit
    out = cp.full(rows.shape, 77, dtype=dtype)  # every byte is written: the padding too
    gather_rows(cp, cp.asarray(rows.table), rows.unit, out)
    np.testing.assert_array_equal(cp.asnumpy(out), merge(parts).x.astype(dtype))


@pytest.fixture(scope="module")
def lstm():
    from service.engines.cudnn import CudnnEngine

    model = model_from_torch(make_torch("lstm", 7, 33, layers=2, seed=4), max_batch_size=16)
    engine = CudnnEngine(model)
    yield model, engine
    engine.close()


def _run(engine, parts):
    merged, launched = launch_batch(engine, parts)
    launched.wait()
    return merged, finish_batch(engine, merged, launched, parts)


@pytest.mark.parametrize("outputs", [("output", "output_last", "h_n", "c_n"), ("output_last",)],
                         ids=["every-output", "many-to-one"])
def test_batches_from_a_mapped_arena_equal_batches_merged_on_the_host(lstm, announced, outputs):
    model, engine = lstm
    key, buf = announced()  # after the engine exists: it maps arenas announced later too
    rng = np.random.default_rng(5)
    parts = _parts_in(buf, rng, [[13, 1, 7], [20], [2, 20, 19, 5], [9, 9]], 7, outputs=outputs)
    plain = [SequenceWork(p.x.copy(), p.lengths, outputs=p.outputs) for p in parts]
    merged, got = _run(engine, parts)
    assert isinstance(merged.x, HostRows)
    merged_host, want = _run(engine, plain)
    assert isinstance(merged_host.x, np.ndarray)
    for g, w, p in zip(got, want, parts):
        assert g.keys() == w.keys() == set(outputs)
        for name in outputs:
            np.testing.assert_array_equal(g[name], w[name], err_msg=name)
        ref = reference_run(model, p.x, p.lengths)
        np.testing.assert_allclose(g["output_last"], ref.output[np.arange(len(p.lengths)), p.lengths - 1],
                                   rtol=RTOL, atol=ATOL)
        if "h_n" in outputs:
            np.testing.assert_allclose(g["h_n"], ref.h_n, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(g["c_n"], ref.c_n, rtol=RTOL, atol=ATOL)
    # one part alone (nothing to merge) goes as it is, through pinned staging
    (merged_alone, alone), (_, alone_host) = _run(engine, parts[:1]), _run(engine, plain[:1])
    assert merged_alone.x is parts[0].x
    for name in outputs:
        np.testing.assert_array_equal(alone[0][name], alone_host[0][name], err_msg=name)
    # the front-end has gone: its arena is unmapped, and a batch still holding its rows merges on the host
    shared_host.withdraw(key)
    merged_after, after = _run(engine, parts)
    assert isinstance(merged_after.x, np.ndarray)
    for g, a in zip(got, after):
        for name in outputs:
            np.testing.assert_array_equal(g[name], a[name], err_msg=name)


def test_an_arena_announced_before_the_engine_is_mapped_and_float16_engines_merge_on_the_host(cp, announced):
    from service.engines.cudnn import CudnnEngine

    _, buf = announced()
    model = model_from_torch(make_torch("gru", 7, 16, seed=6), max_batch_size=8)
    rng = np.random.default_rng(6)
    parts = _parts_in(buf, rng, [[4, 3], [6]], 7)
    engine = CudnnEngine(model)
    try:
        assert isinstance(engine.input_rows([p.x for p in parts], 6), HostRows)
    finally:
        engine.close()
    half = CudnnEngine(model, precision="float16")
    try:
        assert half.input_rows([p.x for p in parts], 6) is None
        merged, got = _run(half, parts)
        assert isinstance(merged.x, np.ndarray)
        ref = reference_run(model, merged.x, merged.lengths)
        np.testing.assert_allclose(np.concatenate([g["h_n"] for g in got]), ref.h_n, rtol=1e-2, atol=1e-2)
    finally:
        half.close()


def test_stream_chunks_from_a_mapped_arena_continue_their_states_as_chunks_merged_on_the_host(lstm, announced):
    """Chunks of 2 KB and more travel in the arenas too: gathered batches of stream chunks (state slots read and
    written on the GPU) give what the same chunks merged on the host give, chunk after chunk."""
    _, engine = lstm
    _, buf = announced()
    rng = np.random.default_rng(8)
    streams, steps = 5, [13, 20, 7]
    whole = [rng.standard_normal((1, sum(steps), 7)).astype(np.float32) for _ in range(streams)]
    results = {}
    for where in ("arena", "host"):
        pool = engine.state_pool(streams)
        slots = [pool.acquire() for _ in range(streams)]
        offset, got = 0, []
        for j, t in enumerate(steps):
            start = sum(steps[:j])
            parts = []
            for k in range(streams):
                chunk = np.ascontiguousarray(whole[k][:, start:start + t])
                if where == "arena":
                    placed = np.ndarray(chunk.shape, chunk.dtype, buffer=buf, offset=offset)
                    placed[...] = chunk
                    offset += (chunk.nbytes + 63) // 64 * 64
                    chunk = placed
                parts.append(SequenceWork(chunk, np.array([t - k % 3]), outputs=frozenset({"output"}),
                                          pool=pool, slot=slots[k], resume=j > 0))
            merged, out = _run(engine, parts)
            assert isinstance(merged.x, HostRows) == (where == "arena")
            got.append([o["output"] for o in out])
        results[where] = got
    for a, h in zip(results["arena"], results["host"]):
        for x, y in zip(a, h):
            np.testing.assert_array_equal(x, y)
