"""The reference engine's compiled GRU kernel reproduces torch.nn.GRU and the NumPy path."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_models import assert_close, packed_from_torch, run_torch, torch_module  # noqa: E402

from service import create_engine  # noqa: E402
from service.engines.reference import native  # noqa: E402
from service.loaders.verify import ATOL, RTOL  # noqa: E402
from service.repository import PackedModel  # noqa: E402
from service.spec import RNNSpec  # noqa: E402

torch.set_num_threads(1)
USABLE, WHY = native.status()
needs_kernel = pytest.mark.skipif(not USABLE, reason=f"native GRU kernel not usable here: {WHY}")


def assert_same_as_numpy_path(model, x, lengths, h0, kernel_out) -> None:
    numpy_path = create_engine(model, "cpu", native=False)
    assert numpy_path.describe()["cpu_kernel"].startswith("numpy")
    ref = numpy_path.forward(x, lengths, h0)
    np.testing.assert_allclose(kernel_out.output, ref.output, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(kernel_out.h_n, ref.h_n, rtol=RTOL, atol=ATOL)


# (input, hidden, batch, lengths): hidden sizes below, at the edge of and past one 16-unit
# block (1, 3, 17, 33), odd input sizes, batch 1, batches that leave partial 8-row tiles,
# ragged batches with length-1 sequences.
SHAPES = [
    (7, 1, 5, [9, 1, 4, 9, 6]),
    (7, 3, 1, [9]),
    (9, 17, 3, [9, 2, 5]),
    (41, 33, 13, [9, 9, 8, 1, 7, 3, 9, 2, 5, 6, 1, 4, 9]),
    (16, 70, 7, [1, 9, 3, 9, 2, 8, 5]),
]
CASES = list(itertools.product(SHAPES, (1, 3), (False, True), (False, True)))


@needs_kernel
@pytest.mark.parametrize("shape,layers,bidir,init", CASES,
                         ids=[f"I{s[0]}-H{s[1]}-B{s[2]}-L{n}-{'bi' if b else 'uni'}-{'h0' if i else 'zero'}"
                              for s, n, b, i in CASES])
def test_kernel_matches_torch_and_numpy(shape, layers, bidir, init):
    i, h, b, lengths = shape
    mod = torch_module("gru", i, h, layers, bidir)
    model = packed_from_torch(mod, "gru")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((b, 9, i)).astype(np.float32)
    lengths = np.array(lengths)
    h0 = rng.standard_normal((b, layers * (2 if bidir else 1), h)).astype(np.float32) if init else None
    kernel = create_engine(model, "cpu", native=True)
    assert kernel.describe()["cpu_kernel"] == "native GRU (AVX-512)"
    out = kernel.forward(x, lengths, h0)
    assert out.c_n is None
    assert_close(out, *run_torch(mod, "gru", x, lengths, h0, None))
    assert not np.any(out.output[lengths == 1, 1:])
    assert_same_as_numpy_path(model, x, lengths, h0, out)


@needs_kernel
@pytest.mark.parametrize("bidir", [False, True])
def test_one_step(bidir):
    mod = torch_module("gru", 5, 19, 2, bidir)
    model = packed_from_torch(mod, "gru")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 1, 5)).astype(np.float32)
    h0 = rng.standard_normal((4, 2 * (2 if bidir else 1), 19)).astype(np.float32)
    out = create_engine(model, "cpu").forward(x, None, h0)
    assert_close(out, *run_torch(mod, "gru", x, np.ones(4, int), h0, None))
    assert_same_as_numpy_path(model, x, None, h0, out)


@needs_kernel
def test_lstm_then_gru_blocks_both_native():
    lstm = torch_module("lstm", 7, 20, 1, True, seed=3)
    gru = torch_module("gru", 40, 6, 2, False, seed=4)
    a, b = packed_from_torch(lstm, "lstm"), packed_from_torch(gru, "gru")
    model = PackedModel(RNNSpec(a.spec.blocks + b.spec.blocks), a.weights + b.weights)
    engine = create_engine(model, "cpu")
    assert engine.describe()["cpu_kernel"] == "native LSTM + GRU (AVX-512)"
    x = np.random.default_rng(5).standard_normal((3, 8, 7)).astype(np.float32)
    lengths = np.array([8, 1, 5])
    y1, _, _ = run_torch(lstm, "lstm", x, lengths, None, None)
    y2, hn2, _ = run_torch(gru, "gru", y1, lengths, None, None)
    output, states = engine.forward_blocks(x, lengths)
    np.testing.assert_allclose(output, y2, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(states[1][0], hn2, rtol=RTOL, atol=ATOL)


@needs_kernel
@pytest.mark.parametrize("variant", [
    {"reset_before": True},
    {"activations": [[{"name": "hard_sigmoid"}, {"name": "tanh"}]]},
    {"clip": 0.5},
    {"reverse": True},
], ids=["reset_before", "activations", "clip", "reverse"])
def test_variants_stay_on_numpy(variant):
    """What cuDNN's GRU cannot express keeps to the NumPy step, whatever ``native`` asks for."""
    model = packed_from_torch(torch_module("gru", 7, 13, 1, False), "gru", variant)
    engine = create_engine(model, "cpu", native=True)
    assert engine.describe()["cpu_kernel"] == "numpy (no plain float32 LSTM or GRU block)"
    x = np.random.default_rng(6).standard_normal((3, 5, 7)).astype(np.float32)
    lengths = np.array([5, 1, 3])
    out = engine.forward(x, lengths)
    ref = create_engine(model, "cpu", native=False).forward(x, lengths)
    np.testing.assert_array_equal(out.output, ref.output)


def test_switches_and_float64_fall_back_to_numpy(monkeypatch):
    mod = torch_module("gru", 7, 13, 1, True)
    model = packed_from_torch(mod, "gru")
    assert create_engine(model, "cpu", dtype=np.float64).describe()["cpu_kernel"] == "numpy (float64 runs on NumPy)"
    monkeypatch.setenv("RNNSERVE_NATIVE_CPU", "0")
    engine = create_engine(model, "cpu")
    assert engine.describe()["cpu_kernel"] == "numpy (RNNSERVE_NATIVE_CPU=0)"
    x = np.random.default_rng(7).standard_normal((2, 4, 7)).astype(np.float32)
    lengths = np.array([4, 2])
    assert_close(engine.forward(x, lengths), *run_torch(mod, "gru", x, lengths, None, None))
