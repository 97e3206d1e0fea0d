"""The reference engine reproduces torch.nn.LSTM/GRU/RNN on CPU, packed sequences included."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_models import MODULES, packed_from_torch, run_torch, torch_module  # noqa: E402

from service import create_engine  # noqa: E402
from service.errors import InvalidInput  # noqa: E402
from service.loaders.verify import ATOL, RTOL  # noqa: E402
from service.repository import PackedModel  # noqa: E402
from service.spec import RNNSpec  # noqa: E402

torch.set_num_threads(1)


CASES = [
    (cell, layers, bidir, ragged, init)
    for cell, layers, bidir, ragged, init in itertools.product(MODULES, (1, 3), (False, True), (False, True), (False, True))
]


@pytest.mark.parametrize("cell,layers,bidir,ragged,init", CASES)
def test_matches_torch(cell, layers, bidir, ragged, init):
    mod = torch_module(cell, 7, 13, layers, bidir)
    model = packed_from_torch(mod, cell)
    rng = np.random.default_rng(1)
    b, t = 5, 9
    x = rng.standard_normal((b, t, 7)).astype(np.float32)
    lengths = np.array([9, 1, 4, 9, 6]) if ragged else np.full(b, t)
    rows = layers * (2 if bidir else 1)
    h0 = rng.standard_normal((b, rows, 13)).astype(np.float32) if init else None
    c0 = rng.standard_normal((b, rows, 13)).astype(np.float32) if init and cell == "lstm" else None
    for dtype, tol in ((np.float64, 1e-10), (np.float32, RTOL)):
        y, hn, cn = run_torch(mod, cell, x, lengths, h0, c0, dtype)
        out = create_engine(model, "cpu", dtype=dtype).forward(x.astype(dtype), lengths, h0, c0)
        atol = 1e-10 if dtype == np.float64 else ATOL
        np.testing.assert_allclose(out.output, y, rtol=tol, atol=atol)
        np.testing.assert_allclose(out.h_n, hn, rtol=tol, atol=atol)
        if cell == "lstm":
            np.testing.assert_allclose(out.c_n, cn, rtol=tol, atol=atol)
        else:
            assert out.c_n is None
        assert not np.any(out.output[1, 1:]) if ragged else True


@pytest.mark.parametrize("bidir", [False, True])
def test_projection_batch1_and_odd_batch(bidir):
    mod = torch_module("lstm", 7, 13, 2, bidir, proj=5).double()
    model = packed_from_torch(mod, "lstm")
    rng = np.random.default_rng(2)
    for b, lengths in ((1, [1]), (1, [8]), (3, [8, 2, 5])):
        x = rng.standard_normal((b, 8, 7))
        y, hn, cn = run_torch(mod, "lstm", x, np.array(lengths), None, None)
        out = create_engine(model, "cpu", dtype=np.float64).forward(x, np.array(lengths))
        assert out.output.shape == (b, 8, (2 if bidir else 1) * 5) and out.h_n.shape[2] == 5 and out.c_n.shape[2] == 13
        np.testing.assert_allclose(out.output, y, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out.h_n, hn, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out.c_n, cn, rtol=1e-10, atol=1e-12)


def test_multi_block_model_runs_blocks_in_order():
    lstm = torch_module("lstm", 7, 13, 2, True, seed=3).double()
    gru = torch_module("gru", 26, 6, 1, False, seed=4).double()
    a, b = packed_from_torch(lstm, "lstm"), packed_from_torch(gru, "gru")
    model = PackedModel(RNNSpec(a.spec.blocks + b.spec.blocks), a.weights + b.weights)
    x = np.random.default_rng(5).standard_normal((4, 6, 7))
    lengths = np.array([6, 3, 1, 5])
    y1, hn1, cn1 = run_torch(lstm, "lstm", x, lengths, None, None)
    y2, hn2, _ = run_torch(gru, "gru", y1, lengths, None, None)
    out = create_engine(model, "cpu", dtype=np.float64).forward(x, lengths)
    np.testing.assert_allclose(out.output, y2, rtol=1e-10, atol=1e-12)
    assert out.h_n is None  # blocks have different state widths (13 vs 6): no single state tensor
    with pytest.raises(InvalidInput, match="different state sizes"):
        create_engine(model, "cpu").forward(x, lengths, h0=np.zeros((4, 5, 13)))


def test_bad_arguments_are_named():
    model = packed_from_torch(torch_module("lstm", 7, 13, 1, False), "lstm")
    eng = create_engine(model, "cpu")
    x = np.zeros((2, 4, 7), np.float32)
    with pytest.raises(InvalidInput, match="input has 3 features per step, the model expects 7"):
        eng.forward(np.zeros((2, 4, 3), np.float32))
    with pytest.raises(InvalidInput, match=r"shape \[batch, time, features\]"):
        eng.forward(np.zeros((4, 7), np.float32))
    with pytest.raises(InvalidInput, match=r"lengths\[1\] = 5 is out of range: every length must be between 1 and T = 4"):
        eng.forward(x, np.array([4, 5]))
    with pytest.raises(InvalidInput, match=r"lengths\[0\] = 0 is out of range"):
        eng.forward(x, np.array([0, 2]))
    with pytest.raises(InvalidInput, match=r"lengths must have shape \[2\]"):
        eng.forward(x, np.array([4]))
    with pytest.raises(InvalidInput, match=r"h0 must have shape \[2, 1, 13\]"):
        eng.forward(x, None, np.zeros((2, 2, 13)))
    with pytest.raises(InvalidInput, match=r"c0 must have shape \[2, 1, 13\]"):
        eng.forward(x, None, None, np.zeros((1, 1, 13)))
    with pytest.raises(InvalidInput, match="at least one sequence"):
        eng.forward(np.zeros((0, 4, 7), np.float32))
    gru = create_engine(packed_from_torch(torch_module("gru", 7, 13, 1, False), "gru"), "cpu")
    with pytest.raises(InvalidInput, match="c0 is only for LSTM"):
        gru.forward(x, None, None, np.zeros((2, 1, 13)))
    with pytest.raises(InvalidInput, match="device 'tpu' is not known"):
        create_engine(model, "tpu")


def test_a_reduced_precision_asked_of_the_cpu_engine_is_logged_and_computed_in_float32(caplog):
    from service.repository import ModelConfig

    mod = torch_module("lstm", 5, 7, 1, False)
    model = packed_from_torch(mod, "lstm")
    model.config = ModelConfig(precision="float16")
    x = np.random.default_rng(0).standard_normal((2, 6, 5)).astype(np.float32)
    lengths = np.array([6, 6])
    with caplog.at_level("WARNING", logger="rnnserve.engines"):
        out = create_engine(model, "cpu").forward(x, lengths)
    assert any("precision float16" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records)
    assert out.output.dtype == np.float32
    y, _, _ = run_torch(mod, "lstm", x, lengths, None, None, np.float32)
    np.testing.assert_allclose(out.output, y, rtol=RTOL, atol=ATOL)
