"""The cuDNN engine's copy kernels (service.engines.cudnn.copies) and the stream-state path built on them.

GPU only (``pytest -m gpu``): transposes and gathers are checked element for element
against NumPy on odd widths, unaligned views and every copy width; streams chunked through
the engine's state pool (``forward_pooled``) against one-shot runs of the reference engine.
"""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.reference import ReferenceEngine
from service.loaders.verify import ATOL, RTOL
from test_state_pool import MODELS, check_pooled_chunks
from test_state_pool import model as pool_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001 - no driver: skip
        pytest.skip(f"no CUDA device: {exc}")
    return cupy


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16, np.uint8])
@pytest.mark.parametrize("shape", [(5, 7, 13), (3, 4, 64), (64, 100, 40), (1, 9, 8), (9, 1, 8), (4, 6, 3, 5)])
def test_swap01_equals_numpy(cp, dtype, shape):
    from service.engines.cudnn.copies import swap01

    host = (np.arange(int(np.prod(shape))) % 251).astype(dtype).reshape(shape)
    got = swap01(cp, cp.asarray(host))
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(cp.asnumpy(got), np.swapaxes(host, 0, 1))


def test_swap01_of_unaligned_and_strided_views(cp):
    from service.engines.cudnn.copies import swap01

    host = np.random.default_rng(0).standard_normal((6, 5, 7)).astype(np.float32)
    dev = cp.asarray(host)
    np.testing.assert_array_equal(cp.asnumpy(swap01(cp, dev[1:])), np.swapaxes(host[1:], 0, 1))   # offset 140 bytes
    np.testing.assert_array_equal(cp.asnumpy(swap01(cp, dev[:, ::2])), np.swapaxes(host[:, ::2], 0, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
@pytest.mark.parametrize("widths", [(13, 13), (64, 32), (3, None)])
def test_gather_and_scatter_slots_equal_numpy(cp, dtype, widths):
    from service.engines.cudnn.copies import gather_slots, scatter_slots

    rng = np.random.default_rng(1)
    layers, slots_n, n = 3, 9, 5
    wh, wc = widths

    def rand(*shape):
        return (rng.standard_normal(shape) * 100).astype(dtype)

    pool = (rand(layers, slots_n, wh), None if wc is None else rand(layers, slots_n, wc))
    pool_d = tuple(None if a is None else cp.asarray(a) for a in pool)
    idx = np.array([7, -1, 2, 7, -1], np.int32)
    index_d = cp.asarray(np.concatenate([np.full(3, -5, np.int32), idx]))  # read at offset 3
    for keep in ((False, False), (True, False), (False, True)):
        big = rand(layers + 2, n, wh)  # h rows are a view at an offset, as a block's slice of h0 is
        rows = (big[1:1 + layers], None if wc is None else rand(layers, n, wc))
        big_d = cp.asarray(big)
        rows_d = (big_d[1:1 + layers], None if wc is None else cp.asarray(rows[1]))
        gather_slots(cp, pool_d, rows_d, index_d, 3, n, keep)
        for which, (p, r, d) in enumerate(zip(pool, rows, rows_d)):
            if p is None:
                continue
            want = r.copy()
            want[:, idx >= 0] = p[:, idx[idx >= 0]]
            if not keep[which]:
                want[:, idx < 0] = 0
            np.testing.assert_array_equal(cp.asnumpy(d), want)
    rows = (rand(layers, n, wh), None if wc is None else rand(layers, n, wc))
    rows_d = tuple(None if a is None else cp.asarray(a) for a in rows)
    targets = np.array([4, -1, 0, 8, -1], np.int32)  # distinct slots: a scatter writes each once
    scatter_slots(cp, rows_d, pool_d, cp.asarray(targets), 0, n)
    for p, r, d in zip(pool, rows, pool_d):
        if p is None:
            continue
        want = p.copy()
        want[:, targets[targets >= 0]] = r[:, targets >= 0]
        np.testing.assert_array_equal(cp.asnumpy(d), want)


def test_state_slots_refuse_mismatched_arrays(cp):
    from service.engines.cudnn.copies import gather_slots

    index = cp.zeros(3, cp.int32)
    with pytest.raises(ValueError, match="one dtype"):
        gather_slots(cp, (cp.zeros((2, 4, 4), cp.float32), None), (cp.zeros((2, 3, 4), cp.float16), None), index, 0, 3)
    with pytest.raises(ValueError, match="rows \\[L, 3, W\\]"):
        gather_slots(cp, (cp.zeros((2, 4, 4), cp.float32), None), (cp.zeros((2, 2, 4), cp.float32), None), index, 0, 3)
    with pytest.raises(ValueError, match="C-contiguous"):
        gather_slots(cp, (cp.zeros((2, 4, 8), cp.float32)[:, :, ::2], None), (cp.zeros((2, 3, 4), cp.float32), None),
                     index, 0, 3)


@pytest.mark.parametrize("blocks", list(MODELS.values()), ids=list(MODELS))
def test_pooled_chunks_equal_whole_sequences(cp, blocks):
    """20 streams chunked through the GPU state pool (growing from 4 slots) == float64 reference runs
    of the whole sequences (outputs, and final states read from the slots); see check_pooled_chunks."""
    from service.engines.cudnn import CudnnEngine

    m = pool_model(blocks, seed=len(blocks))
    eng = CudnnEngine(m, buckets=(1, 2, 4, 8, 16, 32))
    try:
        check_pooled_chunks(eng, ReferenceEngine(m, dtype=np.float64), rtol=RTOL, atol=ATOL)
    finally:
        eng.close()


def test_pooled_chunks_in_float16(cp):
    from service.engines.cudnn import CudnnEngine

    m = pool_model(MODELS["lstm-2-layers"], seed=5)
    eng = CudnnEngine(m, precision="float16", buckets=(1, 2, 4, 8, 16, 32))
    try:
        assert eng.state_pool(4).arrays[0][0].dtype == np.float16  # states stay in the engine's storage dtype
        check_pooled_chunks(eng, ReferenceEngine(m, dtype=np.float64), rtol=1e-2, atol=1e-2)
    finally:
        eng.close()


@pytest.mark.parametrize("layout", ["whole", "first rows", "first steps", "rows and steps", "sequence-major rows"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_results_download_as_they_lie_in_a_larger_buffer(cp, layout, dtype):
    """A graph of a bucketed shape leaves its outputs in the first rows / steps of a larger buffer; they reach
    the host equal to the view, with no copy kernel of CuPy's (compiled on first use) in between."""
    from service.engines.cudnn.transfer import Converter, blocks_with_pitch, download_results

    n, t, f, rows, steps = 5, 7, 13, 8, 12
    host = (np.arange(rows * steps * f) % 997).astype(dtype).reshape(rows, steps, f)
    buf = cp.asarray(host)
    seq = cp.asarray(np.ascontiguousarray(host.transpose(1, 0, 2)))  # [steps, rows, f]
    y = {"whole": buf, "first rows": buf[:n], "first steps": buf[:, :t], "rows and steps": buf[:n, :t],
         "sequence-major rows": seq[:t, :n].transpose(1, 0, 2)}[layout]
    assert blocks_with_pitch(y) or blocks_with_pitch(y.transpose(1, 0, 2))
    hy = cp.asarray(np.ones((2, n, 3), dtype))
    stream = cp.cuda.Stream(non_blocking=True)
    calls = []
    real = cp.ascontiguousarray
    cp.ascontiguousarray = lambda *a, **k: (calls.append(a), real(*a, **k))[1]
    try:
        launched = download_results(cp, Converter(cp, "float16" if dtype == np.float16 else "float32"), stream,
                                    False, y, hy, None, np.dtype(dtype), last_only=False)
    finally:
        cp.ascontiguousarray = real
    launched.wait()
    out = launched.finish()
    assert not calls
    np.testing.assert_array_equal(out.output, cp.asnumpy(y))
    np.testing.assert_array_equal(out.h_n, np.ones((n, 2, 3), dtype))
