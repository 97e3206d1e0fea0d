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
@pytest.mark.parametrize("width", [13, 64, 3])
def test_copy_pairs_equals_numpy(cp, dtype, width):
    from service.engines.cudnn.copies import copy_pairs

    rng = np.random.default_rng(1)
    layers = 3
    src = (rng.standard_normal((layers, 9, width)) * 100).astype(dtype)
    big = np.zeros((layers + 2, 5, width), dtype)  # dst is a row view at an offset, as a block's state is
    pairs = np.array([[7, 0], [2, 4], [7, 2]], np.int32)
    src_d, big_d = cp.asarray(src), cp.asarray(big)
    copy_pairs(cp, src_d, big_d[1:1 + layers], cp.asarray(pairs.ravel()), len(pairs))
    want = big.copy()
    want[1:1 + layers][:, pairs[:, 1]] = src[:, pairs[:, 0]]
    np.testing.assert_array_equal(cp.asnumpy(big_d), want)


def test_copy_pairs_refuses_mismatched_arrays(cp):
    from service.engines.cudnn.copies import copy_pairs

    pairs = cp.zeros(2, cp.int32)
    with pytest.raises(ValueError, match="one dtype"):
        copy_pairs(cp, cp.zeros((2, 3, 4), cp.float32), cp.zeros((2, 3, 4), cp.float16), pairs, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        copy_pairs(cp, cp.zeros((2, 3, 8), cp.float32)[:, :, ::2], cp.zeros((2, 3, 4), cp.float32), pairs, 1)


@pytest.mark.parametrize("blocks", list(MODELS.values()), ids=list(MODELS))
def test_pooled_chunks_equal_whole_sequences(cp, blocks):
    """20 streams chunked through the GPU state pool (growing past 16 slots) == float64 reference runs
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
