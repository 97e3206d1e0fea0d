"""The cuDNN engine's copy kernels (service.engines.cudnn.copies) and the stream-state path built on them.

GPU only (``pytest -m gpu``): transposes and gathers are checked element for element
against NumPy on odd widths, unaligned views and every copy width; chunked runs through
``gather_states``/``forward_blocks`` against one-shot runs of the reference engine.
"""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.reference import ReferenceEngine
from service.loaders.verify import ATOL, RTOL
from service.packing import LayerWeights, pack_block
from service.repository import PackedModel
from service.spec import BlockSpec, RNNSpec

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


def test_gather_rows_from_pointers(cp):
    from service.engines.cudnn.copies import gather_rows

    rng = np.random.default_rng(1)
    layers, width = 3, 13
    big = rng.standard_normal((7, layers, width)).astype(np.float32)
    two = rng.standard_normal((2, layers, width)).astype(np.float32)
    big_d, two_d = cp.asarray(big), cp.asarray(two)
    parts = [big_d[4:5], None, two_d, big_d[0:1]]
    counts = [1, 2, 2, 1]
    got = gather_rows(cp, parts, counts, layers, width, np.float32)
    want = np.concatenate([big[4:5], np.zeros((2, layers, width), np.float32), two, big[0:1]]).transpose(1, 0, 2)
    np.testing.assert_array_equal(cp.asnumpy(got), want)


def test_gather_rows_declines_what_it_cannot_read(cp):
    from service.engines.cudnn.copies import gather_rows

    host = np.zeros((1, 2, 4), np.float32)
    assert gather_rows(cp, [host], [1], 2, 4, np.float32) is None                     # NumPy
    assert gather_rows(cp, [cp.asarray(host, dtype=np.float16)], [1], 2, 4, np.float32) is None
    strided = cp.zeros((1, 2, 8), np.float32)[:, :, ::2]
    assert gather_rows(cp, [strided], [1], 2, 4, np.float32) is None


def _model(cell: str, layers: int, seed: int = 0) -> PackedModel:
    rng = np.random.default_rng(seed)
    i, h = 7, 13
    spec = BlockSpec(cell, i, h, layers)
    g = spec.gates
    ws = []
    for layer in range(layers):
        inp = i if layer == 0 else h
        ws.append(LayerWeights(rng.uniform(-0.4, 0.4, (g * h, inp)), rng.uniform(-0.4, 0.4, (g * h, h)),
                               rng.uniform(-0.2, 0.2, g * h), rng.uniform(-0.2, 0.2, g * h)))
    return PackedModel(RNNSpec((spec,)), [pack_block(spec, ws)])


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_chunked_states_equal_one_shot(cp, cell):
    """Three streams in two chunks through gather_states/forward_blocks == the whole sequences at once."""
    from service.engines.cudnn import CudnnEngine

    model = _model(cell, layers=2)
    eng = CudnnEngine(model, buckets=(1, 2, 4))
    ref = ReferenceEngine(model, dtype=np.float64)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 9, 7)).astype(np.float32)
    try:
        _, first = eng.forward_blocks(x[:2, :4])            # streams 0 and 1 start together
        _, lone = eng.forward_blocks(x[2:, :5])             # stream 2 starts alone, longer first chunk
        parts = [[(h[1:2], None if c is None else c[1:2]) for h, c in first],          # stream 1
                 [(h[0:1], None if c is None else c[0:1]) for h, c in lone],            # stream 2
                 [(h[0:1], None if c is None else c[0:1]) for h, c in first]]           # stream 0
        states = eng.gather_states(parts, [1, 1, 1])
        second = np.stack([x[1, 4:8], x[2, 5:9], x[0, 4:8]])
        out, finals = eng.forward_blocks(second, np.array([4, 4, 4]), states)
    finally:
        eng.close()
    whole = ref.forward(x[[1, 2, 0], :].astype(np.float64), np.array([8, 9, 8]))
    np.testing.assert_allclose(out[0], whole.output[0, 4:8], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out[1], whole.output[1, 5:9], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out[2], whole.output[2, 4:8], rtol=RTOL, atol=ATOL)
    h_final = cp.asnumpy(finals[0][0])
    np.testing.assert_allclose(h_final, whole.h_n, rtol=RTOL, atol=ATOL)
    if cell == "lstm":
        np.testing.assert_allclose(cp.asnumpy(finals[0][1]), whole.c_n, rtol=RTOL, atol=ATOL)
