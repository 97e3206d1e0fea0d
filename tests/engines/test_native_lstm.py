"""The reference engine's compiled LSTM kernel reproduces torch.nn.LSTM and the NumPy path."""
from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_models import assert_close, packed_from_torch, run_torch, torch_module  # noqa: E402

from service import create_engine  # noqa: E402
from service.engines.reference import native  # noqa: E402
from service.loaders.verify import ATOL, RTOL  # noqa: E402

torch.set_num_threads(1)
USABLE, WHY = native.status()
needs_kernel = pytest.mark.skipif(not USABLE, reason=f"native LSTM kernel not usable here: {WHY}")


# (input, hidden, proj, batch, lengths): odd sizes, a hidden size past one 16-unit block,
# batch 1, batches that leave partial 6-row tiles, ragged batches with length-1 sequences.
SHAPES = [
    (7, 13, 0, 5, [9, 1, 4, 9, 6]),
    (7, 13, 0, 1, [9]),
    (7, 13, 5, 3, [9, 2, 5]),
    (40, 37, 0, 13, [9, 9, 8, 1, 7, 3, 9, 2, 5, 6, 1, 4, 9]),
    (16, 70, 67, 7, [1, 9, 3, 9, 2, 8, 5]),
]
CASES = list(itertools.product(SHAPES, (1, 3), (False, True), (False, True)))


@needs_kernel
@pytest.mark.parametrize("shape,layers,bidir,init", CASES,
                         ids=[f"I{s[0]}-H{s[1]}-P{s[2]}-B{s[3]}-L{n}-{'bi' if b else 'uni'}-{'h0' if i else 'zero'}"
                              for s, n, b, i in CASES])
def test_kernel_matches_torch_and_numpy(shape, layers, bidir, init):
    i, h, proj, b, lengths = shape
    mod = torch_module("lstm", i, h, layers, bidir, proj)
    model = packed_from_torch(mod, "lstm")
    rng = np.random.default_rng(1)
    t = 9
    x = rng.standard_normal((b, t, i)).astype(np.float32)
    lengths = np.array(lengths)
    rows, ho = layers * (2 if bidir else 1), proj or h
    h0 = rng.standard_normal((b, rows, ho)).astype(np.float32) if init else None
    c0 = rng.standard_normal((b, rows, h)).astype(np.float32) if init else None
    kernel = create_engine(model, "cpu", native=True)
    assert kernel.describe()["cpu_kernel"].startswith("native")
    out = kernel.forward(x, lengths, h0, c0)
    assert_close(out, *run_torch(mod, "lstm", x, lengths, h0, c0))
    assert not np.any(out.output[lengths == 1, 1:])
    numpy_path = create_engine(model, "cpu", native=False)
    assert numpy_path.describe()["cpu_kernel"].startswith("numpy")
    ref = numpy_path.forward(x, lengths, h0, c0)
    for a, r in ((out.output, ref.output), (out.h_n, ref.h_n), (out.c_n, ref.c_n)):
        np.testing.assert_allclose(a, r, rtol=RTOL, atol=ATOL)


@needs_kernel
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("hidden,batch", [(128, 1), (128, 16), (512, 64)])
def test_kernel_at_benchmark_sizes(cell, hidden, batch):
    """Both kernels at the benchmark's shapes (both threads where the rule picks two, full tiles: 6 rows for
    LSTM, 8 for GRU) over 100 steps."""
    mod = torch_module(cell, hidden, hidden, 2, False)
    x = np.random.default_rng(3).standard_normal((batch, 100, hidden)).astype(np.float32)
    lengths = np.full(batch, 100)
    lengths[-1] = 37
    out = create_engine(packed_from_torch(mod, cell), "cpu").forward(x, lengths)
    assert_close(out, *run_torch(mod, cell, x, lengths, None, None))


@needs_kernel
@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu"])
def test_other_cells_stay_on_numpy_and_match_torch(cell):
    mod = torch_module(cell, 7, 13, 2, True)
    engine = create_engine(packed_from_torch(mod, cell), "cpu")
    assert engine.describe()["cpu_kernel"] == "numpy (no plain float32 LSTM or GRU block)"
    x = np.random.default_rng(4).standard_normal((3, 6, 7)).astype(np.float32)
    lengths = np.array([6, 1, 4])
    assert_close(engine.forward(x, lengths), *run_torch(mod, cell, x, lengths, None, None))


def test_switches_and_float64_fall_back_to_numpy(monkeypatch):
    model = packed_from_torch(torch_module("lstm", 7, 13, 1, False), "lstm")
    assert create_engine(model, "cpu", dtype=np.float64).describe()["cpu_kernel"] == "numpy (float64 runs on NumPy)"
    monkeypatch.setenv("RNNSERVE_NATIVE_CPU", "0")
    engine = create_engine(model, "cpu")
    assert engine.describe()["cpu_kernel"] == "numpy (RNNSERVE_NATIVE_CPU=0)"
    x = np.random.default_rng(5).standard_normal((2, 4, 7)).astype(np.float32)
    assert_close(engine.forward(x), *run_torch(torch_module("lstm", 7, 13, 1, False), "lstm", x, np.array([4, 4]),
                                                None, None))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc): the NumPy path is expected")
def test_extension_is_built_where_a_compiler_exists():
    """`pip install -e .` compiles the kernel when cc exists; a silent fallback would hide a 2-3x slowdown."""
    assert native.built(), "service/engines/reference/native/_kernels was not built; run `pip install -e .`"


@needs_kernel
@pytest.mark.parametrize("cell, proj", [("lstm", 0), ("lstm", 21), ("gru", 0)])
@pytest.mark.parametrize("bidir", [False, True])
def test_a_sequence_gives_the_same_bits_alone_and_in_any_batch(cell, proj, bidir):
    # Rows are tiled a few at a time and the last tile takes the rest, so a sequence's tile size depends on the
    # batch around it; the kernel sums in one order for every tile size, so batching never changes a result.
    mod = torch_module(cell, 11, 37, 2, bidir, proj)
    engine = create_engine(packed_from_torch(mod, cell), "cpu", native=True)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((17, 12, 11)).astype(np.float32)
    lengths = rng.integers(1, 13, 17)
    alone = [engine.forward(x[i:i + 1, :n], np.array([n])) for i, n in enumerate(lengths)]
    for b in (2, 3, 7, 9, 17):  # tails of 1, 2 and more rows
        out = engine.forward(x[:b], lengths[:b])
        for i in range(b):
            n = lengths[i]
            assert np.array_equal(out.output[i, :n], alone[i].output[0]), (b, i)
            assert np.array_equal(out.h_n[i], alone[i].h_n[0]), (b, i)
