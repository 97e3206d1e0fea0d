"""The cuDNN engine against the float64 reference engine and against torch.nn.LSTM/GRU/RNN on CUDA.

GPU tests carry ``@pytest.mark.gpu`` (run them with ``pytest -m gpu`` on a machine with
CUDA, CuPy and cuDNN 9); the rest run anywhere. fp32 results use FMA math and are held to
the converter's tolerance (service.loaders.verify RTOL/ATOL = 1e-5) except the T=2000 case,
where float32 rounding accumulates over the steps and 1e-4 is used. float16 is held to 1e-2,
bfloat16 (8-bit mantissa) to 5e-2.
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import pytest

from service.engines import create_engine
from service.engines.cudnn import CudnnEngine
from service.engines.cudnn.library import ALGO_NAMES, RELEASES_GIL, load_library
from service.engines.reference import ReferenceEngine
from service.errors import EngineUnavailable, InvalidInput, RNNServeError
from service.loaders.verify import ATOL, RTOL
from service.packing import LayerWeights, pack_block
from service.repository import ModelConfig, PackedModel
from service.spec import BlockSpec, RNNSpec

gpu = pytest.mark.gpu
ALGOS = ["standard", "persist_static", "persist_dynamic", "persist_static_small_h"]


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# -- building models from torch modules -------------------------------------------------------------

def make_torch(cell: str, input_size: int, hidden: int, layers: int = 1, bidirectional: bool = False,
               proj: int = 0, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    kw = dict(num_layers=layers, batch_first=True, bidirectional=bidirectional)
    if cell == "lstm":
        mod = torch.nn.LSTM(input_size, hidden, proj_size=proj, **kw)
    elif cell == "gru":
        mod = torch.nn.GRU(input_size, hidden, **kw)
    else:
        mod = torch.nn.RNN(input_size, hidden, nonlinearity=cell.split("_")[1], **kw)
    return mod.eval()


def block_from_torch(mod) -> tuple[BlockSpec, np.ndarray]:
    kind = type(mod).__name__
    cell = {"LSTM": "lstm", "GRU": "gru"}.get(kind) or f"rnn_{mod.nonlinearity}"
    sd = {k: v.detach().double().cpu().numpy() for k, v in mod.state_dict().items()}
    layers = []
    for layer in range(mod.num_layers):
        for d in range(2 if mod.bidirectional else 1):
            s = f"_l{layer}" + ("_reverse" if d else "")
            layers.append(LayerWeights(sd["weight_ih" + s], sd["weight_hh" + s], sd["bias_ih" + s], sd["bias_hh" + s],
                                       sd.get("weight_hr" + s)))
    spec = BlockSpec(cell, mod.input_size, mod.hidden_size, mod.num_layers, mod.bidirectional,
                     getattr(mod, "proj_size", 0))
    return spec, pack_block(spec, layers)


def model_from_torch(*mods, precision: str = "float32", max_batch_size: int = 8) -> PackedModel:
    specs, flats = zip(*(block_from_torch(m) for m in mods))
    cfg = ModelConfig(precision=precision, max_batch_size=max_batch_size)
    return PackedModel(RNNSpec(tuple(specs)), list(flats), config=cfg, name="test")


def torch_run(mods, x, lengths=None, h0=None, c0=None, dtype="float32"):
    """Chain torch modules on CUDA (packed sequences for ragged batches); contract-shaped NumPy results."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    tdt = getattr(torch, dtype)
    b, t = x.shape[:2]
    seq = torch.from_numpy(np.ascontiguousarray(x)).to("cuda", tdt)
    if lengths is not None:
        seq = pack_padded_sequence(seq, torch.as_tensor(np.asarray(lengths, dtype=np.int64)), batch_first=True,
                                   enforce_sorted=False)
    hs, cs = [], []
    row = crow = 0
    with torch.no_grad():
        for mod in mods:
            mod = mod.to("cuda", tdt)
            rows = mod.num_layers * (2 if mod.bidirectional else 1)
            hx = None
            if h0 is not None:
                h = torch.from_numpy(np.ascontiguousarray(h0[:, row:row + rows].transpose(1, 0, 2))).to("cuda", tdt)
                hx = h
                if isinstance(mod, torch.nn.LSTM):
                    c = torch.from_numpy(np.ascontiguousarray(c0[:, crow:crow + rows].transpose(1, 0, 2))).to("cuda", tdt)
                    hx = (h, c)
            seq, state = mod(seq, hx)
            if isinstance(mod, torch.nn.LSTM):
                hs.append(state[0])
                cs.append(state[1])
                crow += rows
            else:
                hs.append(state)
            row += rows
    if lengths is not None:
        seq, _ = pad_packed_sequence(seq, batch_first=True, total_length=t)
    out = seq.float().cpu().numpy()
    h_n = torch.cat(hs).transpose(0, 1).float().cpu().numpy()
    c_n = torch.cat(cs).transpose(0, 1).float().cpu().numpy() if cs else None
    return out, h_n, c_n


def reference_run(model, x, lengths=None, h0=None, c0=None):
    ref = ReferenceEngine(model, dtype=np.float64)
    f64 = lambda a: None if a is None else np.asarray(a, dtype=np.float64)  # noqa: E731
    return ref.forward(f64(x), lengths, f64(h0), f64(c0))


def check(got, want, rtol=RTOL, atol=ATOL, what=""):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                               rtol=rtol, atol=atol, err_msg=what)


def check_all(out, want, rtol=RTOL, atol=ATOL):
    check(out.output, want[0] if isinstance(want, tuple) else want.output, rtol, atol, "output")
    w_h = want[1] if isinstance(want, tuple) else want.h_n
    w_c = want[2] if isinstance(want, tuple) else want.c_n
    check(out.h_n, w_h, rtol, atol, "h_n")
    if w_c is not None:
        check(out.c_n, w_c, rtol, atol, "c_n")
    else:
        assert out.c_n is None


def check_padding_zero(out, lengths):
    for i, n in enumerate(lengths):
        assert not np.any(np.asarray(out)[i, n:]), f"sequence {i} has non-zero output past its length {n}"


def rand(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # exact fp32 on both sides
    yield torch
    torch.backends.cudnn.allow_tf32 = old


# -- GPU: correctness ---------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_matches_reference(cell, layers, bidirectional):
    mod = make_torch(cell, 7, 16, layers, bidirectional, seed=layers)
    model = model_from_torch(mod)
    x, lengths = rand((5, 9, 7), seed=1), np.array([9, 1, 4, 9, 6])
    eng = CudnnEngine(model, autotune=False)
    try:
        out = eng.forward(x, lengths)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths))
    check_padding_zero(out.output, lengths)


@gpu
@pytest.mark.parametrize("layout", ["batch_major", "seq_major"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_matches_torch(torch_cuda, cell, bidirectional, layout):
    mod = make_torch(cell, 10, 24, 2, bidirectional, seed=3)
    model = model_from_torch(mod, max_batch_size=64)
    x = rand((33, 12, 10), seed=2)
    lengths = np.random.default_rng(3).integers(1, 13, size=33)
    lengths[0] = 1
    eng = CudnnEngine(model, autotune=False, layout=layout)
    try:
        out = eng.forward(x, lengths)
        full = eng.forward(x)  # same batch size right after a ragged call: descriptors and workspace re-set
        again = eng.forward(x, lengths)
    finally:
        eng.close()
    check_all(out, torch_run([mod], x, lengths))
    check_all(full, torch_run([mod], x))
    np.testing.assert_array_equal(again.output, out.output)


@gpu
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_seq_major_layout_everywhere(cell):
    import cupy as cp

    mod = make_torch(cell, 6, 16, 2, True, seed=41)
    model = model_from_torch(mod)
    rows = model.spec.state_layers
    x, lengths = rand((7, 9, 6), seed=42), np.array([9, 1, 6, 9, 2, 9, 9])
    h0 = rand((7, rows, 16), 43, 0.5)
    c0 = rand((7, rows, 16), 44, 0.5) if cell == "lstm" else None
    try:
        eng = CudnnEngine(model, layout="seq_major", algorithm="persist_static")
    except EngineUnavailable:
        eng = CudnnEngine(model, layout="seq_major")
    try:
        assert {b["layout"] for b in eng.describe()["layouts"]} == {"seq_major"}
        out = eng.forward(x, lengths, h0, c0)
        full = eng.forward(x, None, h0, c0, output_device="device")
        one = eng.forward(x[:1])
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths, h0, c0))
    check_padding_zero(out.output, lengths)
    check(cp.asnumpy(full.output), reference_run(model, x, None, h0, c0).output)
    check(one.output, reference_run(model, x[:1]).output)


@gpu
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
def test_lstm_projection(torch_cuda, layers, bidirectional):
    mod = make_torch("lstm", 6, 20, layers, bidirectional, proj=8, seed=4)
    model = model_from_torch(mod)
    x, lengths = rand((5, 11, 6), seed=5), np.array([11, 3, 1, 7, 11])
    h0, c0 = rand((5, model.spec.state_layers, 8), 6, 0.5), rand((5, model.spec.state_layers, 20), 7, 0.5)
    eng = CudnnEngine(model)
    try:
        out = eng.forward(x, lengths, h0, c0)
    finally:
        eng.close()
    assert out.output.shape == (5, 11, 8 * (2 if bidirectional else 1))
    check_all(out, reference_run(model, x, lengths, h0, c0))
    check_all(out, torch_run([mod], x, lengths, h0, c0))


@gpu
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_initial_states(torch_cuda, cell):
    mod = make_torch(cell, 5, 12, 2, True, seed=8)
    model = model_from_torch(mod)
    rows = model.spec.state_layers
    x, lengths = rand((6, 8, 5), seed=9), np.array([8, 1, 2, 8, 5, 3])
    h0 = rand((6, rows, 12), 10, 0.5)
    c0 = rand((6, rows, 12), 11, 0.5) if cell == "lstm" else None
    eng = CudnnEngine(model, autotune=False)
    try:
        out = eng.forward(x, lengths, h0, c0)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths, h0, c0))
    check_all(out, torch_run([mod], x, lengths, h0, c0))


@gpu
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_each_algorithm(cell, algorithm, ragged):
    mod = make_torch(cell, 16, 32, 2, False, seed=12)
    model = model_from_torch(mod)
    try:
        eng = CudnnEngine(model, algorithm=algorithm)
    except EngineUnavailable as exc:
        pytest.skip(f"cuDNN refuses {algorithm} here: {exc}")
    x = rand((4, 10, 16), seed=13)
    lengths = np.array([10, 3, 10, 1]) if ragged else None
    h0 = rand((4, 2, 32), 14, 0.5)
    try:
        chosen = {c["bucket"]: c["algo"] for c in eng.describe()["algorithms"][0]["buckets"]}
        out = eng.forward(x, lengths, h0)
    finally:
        eng.close()
    assert chosen[4] == algorithm, chosen
    check_all(out, reference_run(model, x, lengths, h0))
    if ragged:
        check_padding_zero(out.output, lengths)


@gpu
def test_forced_persistent_with_projection_is_refused_or_exact():
    mod = make_torch("lstm", 8, 24, 1, False, proj=12, seed=15)
    model = model_from_torch(mod)
    try:
        eng = CudnnEngine(model, algorithm="persist_static")
    except EngineUnavailable as exc:
        assert "persist_static" in str(exc)
        return
    x = rand((2, 6, 8), seed=16)
    try:
        out = eng.forward(x)
    finally:
        eng.close()
    check_all(out, reference_run(model, x))


@gpu
def test_without_graphs_layouts_are_timed_as_served_uncaptured():
    mod = make_torch("gru", 16, 24, 1, False, seed=21)
    model = model_from_torch(mod, max_batch_size=8)
    eng = CudnnEngine(model, graph_memory_mb=0)
    try:
        rows = eng.describe()["layouts"]
        assert rows and all(r["timed"] == "uncaptured" and "batch_major_long_ms" not in r for r in rows)
        assert not eng._table.replay_lines
        x, lengths = rand((3, 9, 16), seed=3), np.array([9, 2, 5])
        check_all(eng.forward(x, lengths), reference_run(model, x, lengths))
    finally:
        eng.close()


@gpu
def test_autotune_describe_and_buckets():
    mod = make_torch("lstm", 32, 64, 2, False, seed=17)
    model = model_from_torch(mod, max_batch_size=64)
    eng = CudnnEngine(model)
    try:
        info = eng.describe()
        print(info)
        buckets = info["algorithms"][0]["buckets"]
        assert [b["bucket"] for b in buckets] == [1, 2, 4, 8, 16, 32, 64]
        assert info["algorithms"][0]["long_steps"] == 4 * info["algorithms"][0]["steps"]
        for b in buckets:
            assert b["algo"] in ALGO_NAMES.values() and b["time_ms"] > 0
            assert b["algo_long"] in ALGO_NAMES.values() and b["long_ms"] > 0
            assert all(t["long_ms"] > 0 for t in b["tried"] if "time_ms" in t)  # every usable trial has its line
            # graphs on (the default): each usable trial's uncaptured launches are timed too (its host line)
            assert all(t["host_ms"] > 0 and t["long_host_ms"] > 0 for t in b["tried"] if "time_ms" in t)
            assert b["long_host_ms"] > 0
        assert info["weights_upload"][0]["mode"] == "single copy"
        assert [b["layout"] for b in info["layouts"]] and all(
            b["layout"] in ("batch_major", "seq_major") and "batch_major_ms" in b for b in info["layouts"])
        # graphs on: both layouts timed as replays at both tuning lengths, and the chosen one's times are
        # the bucket's replay line, the GPU time the planner uses for those algorithms
        table = eng._table
        for row in info["layouts"]:
            assert row["timed"] == "replay", row
            assert all(row[f"{n}_ms"] > 0 and row[f"{n}_long_ms"] > 0 for n in ("batch_major", "seq_major"))
            line = table.replay_lines[row["bucket"]]
            assert line.time_ms == row[f"{row['layout']}_ms"] and line.long_ms == row[f"{row['layout']}_long_ms"]
            if line.algos == line.long_algos:
                assert table.gpu_ms(line.algos, row["bucket"], table.long_steps) == pytest.approx(line.long_ms)
        assert info["load_ms"] < 30000
        for batch, lengths in ((1, None), (5, np.array([20, 1, 7, 20, 20])), (64, None), (37, None)):
            x = rand((batch, 20, 32), seed=batch)
            check_all(eng.forward(x, lengths), reference_run(model, x, lengths))
    finally:
        eng.close()


@gpu
@pytest.mark.parametrize("ragged", [False, True])
def test_batch_1024(ragged):
    mod = make_torch("lstm", 8, 32, 1, True, seed=18)
    model = model_from_torch(mod, max_batch_size=64)
    x = rand((1024, 16, 8), seed=19)
    lengths = np.random.default_rng(20).integers(1, 17, size=1024) if ragged else None
    eng = CudnnEngine(model)
    try:
        out = eng.forward(x, lengths)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths))


@gpu
def test_long_sequence_t2000():
    mod = make_torch("lstm", 4, 32, 1, True, seed=21)
    model = model_from_torch(mod)
    x, lengths = rand((3, 2000, 4), seed=22), np.array([2000, 1, 1500])
    eng = CudnnEngine(model)
    try:
        out = eng.forward(x, lengths)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths), rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("precision,tol", [("float16", 1e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_low_precision(torch_cuda, cell, precision, tol):
    mod = make_torch(cell, 16, 32, 2, True, seed=23)
    model = model_from_torch(mod, precision=precision)
    x, lengths = rand((5, 12, 16), seed=24), np.array([12, 1, 5, 12, 9])
    try:
        eng = CudnnEngine(model)
    except EngineUnavailable as exc:
        if precision == "bfloat16":
            pytest.skip(f"this cuDNN refuses bfloat16 RNNs: {exc}")
        raise
    try:
        assert eng.describe()["precision"] == precision
        out = eng.forward(x, lengths)
        assert out.output.dtype == np.float32
        uniform = eng.forward(x)
        if precision == "float16":
            half = eng.forward(x.astype(np.float16))
            assert half.output.dtype == np.float16
            check(half.output, uniform.output, atol=tol, rtol=tol)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths), rtol=tol, atol=tol)
    check_all(uniform, reference_run(model, x), rtol=tol, atol=tol)
    if precision == "float16":
        check_all(out, torch_run([mod], x, lengths, dtype="float16"), rtol=tol, atol=tol)


@gpu
@pytest.mark.parametrize("algorithm", [None, "persist_static"])
def test_multi_block(torch_cuda, algorithm):
    lstm = make_torch("lstm", 8, 16, 1, True, seed=25)
    gru = make_torch("gru", 32, 16, 2, False, seed=26)
    rnn = make_torch("rnn_tanh", 16, 16, 1, False, seed=27)
    model = model_from_torch(lstm, gru, rnn)
    assert [b.cell for b in model.spec.blocks] == ["lstm", "gru", "rnn_tanh"]
    x, lengths = rand((6, 10, 8), seed=28), np.array([10, 1, 4, 10, 7, 10])
    h0 = rand((6, model.spec.state_layers, 16), 29, 0.5)
    c0 = rand((6, model.spec.cell_state_layers, 16), 30, 0.5)
    try:
        eng = CudnnEngine(model, algorithm=algorithm)
    except EngineUnavailable as exc:
        pytest.skip(f"cuDNN refuses {algorithm}: {exc}")
    try:
        out = eng.forward(x, lengths, h0, c0)
        full = eng.forward(x)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths, h0, c0))
    check_all(out, torch_run([lstm, gru, rnn], x, lengths, h0, c0))
    check_all(full, reference_run(model, x))


@gpu
def test_per_matrix_upload_matches_single_copy():
    mod = make_torch("lstm", 6, 20, 2, True, proj=10, seed=31)
    model = model_from_torch(mod)
    x, lengths = rand((3, 7, 6), seed=32), np.array([7, 2, 5])
    a = CudnnEngine(model, autotune=False)
    b = CudnnEngine(model, autotune=False, force_per_matrix_upload=True)
    try:
        assert a.describe()["weights_upload"][0]["mode"] == "single copy"
        assert b.describe()["weights_upload"][0]["mode"] == "per matrix"
        out_a, out_b = a.forward(x, lengths), b.forward(x, lengths)
    finally:
        a.close()
        b.close()
    np.testing.assert_array_equal(out_a.output, out_b.output)
    np.testing.assert_array_equal(out_a.h_n, out_b.h_n)
    check_all(out_b, reference_run(model, x, lengths))


@gpu
def test_cupy_inputs_and_device_outputs():
    import cupy as cp

    mod = make_torch("lstm", 6, 16, 2, True, seed=33)
    model = model_from_torch(mod)
    rows = model.spec.state_layers
    x, lengths = rand((4, 9, 6), seed=34), np.array([9, 1, 6, 9])
    h0, c0 = rand((4, rows, 16), 35, 0.5), rand((4, rows, 16), 36, 0.5)
    eng = CudnnEngine(model, autotune=False)
    try:
        host = eng.forward(x, lengths, h0, c0)
        dev = eng.forward(cp.asarray(x), cp.asarray(lengths), cp.asarray(h0), cp.asarray(c0), output_device="device")
        assert isinstance(dev.output, cp.ndarray) and isinstance(dev.h_n, cp.ndarray) and isinstance(dev.c_n, cp.ndarray)
        mixed = eng.forward(x, lengths, h0, c0, output_device="device")
        back = eng.forward(cp.asarray(x), lengths, h0, c0)
        assert isinstance(back.output, np.ndarray)
    finally:
        eng.close()
    for other in (dev, mixed):
        np.testing.assert_array_equal(cp.asnumpy(other.output), host.output)
        np.testing.assert_array_equal(cp.asnumpy(other.h_n), host.h_n)
        np.testing.assert_array_equal(cp.asnumpy(other.c_n), host.c_n)
    np.testing.assert_array_equal(back.output, host.output)
    check_all(host, reference_run(model, x, lengths, h0, c0))


@gpu
def test_tf32_option():
    mod = make_torch("gru", 32, 64, 1, False, seed=37)
    model = model_from_torch(mod)
    x = rand((8, 20, 32), seed=38)
    eng = CudnnEngine(model, allow_tf32=True, autotune=False)
    try:
        assert eng.describe()["math_type"] == "default"
        out = eng.forward(x)
    finally:
        eng.close()
    check_all(out, reference_run(model, x), rtol=1e-2, atol=1e-2)


@gpu
def test_bad_input_is_rejected_with_a_message():
    model = model_from_torch(make_torch("gru", 4, 8, seed=39))
    eng = CudnnEngine(model, autotune=False)
    try:
        with pytest.raises(InvalidInput, match="features"):
            eng.forward(rand((2, 3, 5)))
        with pytest.raises(InvalidInput, match="output_device"):
            eng.forward(rand((2, 3, 4)), output_device="gpu")
        with pytest.raises(InvalidInput, match="lengths"):
            eng.forward(rand((2, 3, 4)), np.array([0, 3]))
    finally:
        eng.close()
    for call in (lambda: eng.forward(rand((2, 3, 4))), lambda: eng.forward(rand((2, 3, 4)), output_device="device"),
                 lambda: eng.launch(rand((2, 3, 4))), lambda: eng.launch_blocks(rand((2, 3, 4))),
                 lambda: eng.forward_blocks(rand((2, 3, 4))), lambda: eng.state_pool(4)):
        with pytest.raises(EngineUnavailable, match="closed"):
            call()


@gpu
def test_cudnn_error_names_the_call():
    import ctypes

    from service.engines.cudnn.library import CudnnError, get_library

    lib = get_library()
    desc = ctypes.c_void_p()
    lib.cudnnCreateRNNDescriptor(ctypes.byref(desc))
    try:
        with pytest.raises(CudnnError) as info:
            lib.cudnnSetRNNDescriptor_v8(desc, 0, 2, 2, 0, 0, 0, 0, 3, 8, 0, 0, 1, None, 1)
    finally:
        lib.cudnnDestroyRNNDescriptor(desc)
    assert isinstance(info.value, RNNServeError)
    assert "cudnnSetRNNDescriptor_v8" in str(info.value) and "CUDNN_STATUS_" in str(info.value)


@gpu
def test_factory_picks_cudnn_for_cuda_and_auto():
    model = model_from_torch(make_torch("lstm", 4, 8, seed=40))
    for device in ("cuda", "auto"):
        eng = create_engine(model, device, autotune=False)
        try:
            assert isinstance(eng, CudnnEngine)
        finally:
            eng.close()


# -- anywhere: no GPU needed -----------------------------------------------------------------------

def _tiny_model(variant=None) -> PackedModel:
    spec = BlockSpec("lstm", 3, 4, variant=variant or {})
    rng = np.random.default_rng(0)
    lw = LayerWeights(rng.standard_normal((16, 3)), rng.standard_normal((16, 4)), rng.standard_normal(16),
                      rng.standard_normal(16))
    extras = {"block0.peephole": np.zeros((1, 3, 4), np.float32)} if variant and variant.get("peephole") else {}
    return PackedModel(RNNSpec((spec,)), [pack_block(spec, [lw])], extras, name="tiny")


@pytest.mark.skipif(_has_gpu(), reason="checks the message on a machine without a GPU")
def test_cuda_without_gpu_raises_engine_unavailable():
    with pytest.raises(EngineUnavailable, match="cuDNN|CuPy|GPU"):
        create_engine(_tiny_model(), "cuda")


def _fallback_levels(caplog) -> list[int]:
    return [r.levelno for r in caplog.records if "runs on the reference engine" in r.getMessage()]


@pytest.mark.skipif(_has_gpu(), reason="checks the fallback on a machine without a GPU")
def test_auto_without_gpu_falls_back_to_reference(caplog):
    caplog.set_level(logging.INFO, logger="rnnserve.engines")
    assert isinstance(create_engine(_tiny_model(), "auto"), ReferenceEngine)
    # a CPU machine is what "auto" is for: no warning per model; a machine with the NVIDIA driver whose GPU
    # does not work is a fault, and warns
    expected = logging.WARNING if os.path.exists("/dev/nvidiactl") else logging.INFO
    assert _fallback_levels(caplog) == [expected]


def test_variant_is_refused_by_name_and_auto_falls_back(caplog):
    caplog.set_level(logging.INFO, logger="rnnserve.engines")
    model = _tiny_model({"peephole": True})
    with pytest.raises(EngineUnavailable, match="block 0 uses variant 'peephole' which cuDNN cannot run"):
        CudnnEngine(model)
    assert isinstance(create_engine(model, "auto"), ReferenceEngine)
    assert _fallback_levels(caplog) == [logging.WARNING]  # the model, not the machine: worth a warning


def test_library_search_names_everything_tried(tmp_path):
    bogus = tmp_path / "libcudnn.so.9"
    bogus.write_bytes(b"not a library")
    tried = [("$RNNSERVE_CUDNN_LIBRARY", str(tmp_path / "missing.so")), ("the wheel", str(bogus)),
             ("the system loader", "libcudnn_no_such_library.so.9")]
    with pytest.raises(EngineUnavailable) as info:
        load_library(tried)
    msg = str(info.value)
    for _, path in tried:
        assert path in msg
    assert "RNNSERVE_CUDNN_LIBRARY" in msg


def _keeps_gil(fn) -> bool:
    return bool(getattr(fn, "_flags_", 0) & ctypes._FUNCFLAG_PYTHONAPI)


@gpu
def test_long_calls_release_the_gil():
    # The event loop must keep serving while a batch's cudnnRNNForward launches its kernels.
    lib = load_library()
    for name, fn in lib.functions.items():
        assert _keeps_gil(fn) == (name not in RELEASES_GIL), name
    assert {"cudnnRNNForward", "cudnnBuildRNNDynamic"} <= RELEASES_GIL


@gpu
def test_blocking_sync_gives_the_same_results():
    mod = make_torch("gru", 6, 16, 2, True, seed=41)
    model = model_from_torch(mod)
    x, lengths = rand((5, 11, 6), seed=42), np.array([11, 1, 6, 11, 3])
    spin, sleep = CudnnEngine(model, autotune=False), CudnnEngine(model, autotune=False, blocking_sync=True)
    try:
        a, b = spin.forward(x, lengths), sleep.forward(x, lengths)
    finally:
        spin.close()
        sleep.close()
    np.testing.assert_array_equal(a.output, b.output)
    np.testing.assert_array_equal(a.h_n, b.h_n)
    check_all(b, reference_run(model, x, lengths))


@gpu
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_padded_run_without_states_is_exact(monkeypatch, cell):
    import service.engines.cudnn.engine as engine_module
    from service.engines.cudnn.autotune import Group

    def padded_plan(table, b, t, lens, pad_ok=False):
        assert pad_ok, "a causal model whose states are not needed may be padded"
        return [Group(None, b, t, table.algos_for(b), True, table.seq_major_for(b))]

    mod = make_torch(cell, 6, 24, 2, False, seed=43)
    model = model_from_torch(mod)
    rows = model.spec.state_layers
    x, lengths = rand((6, 13, 6), seed=44), np.array([13, 1, 7, 13, 2, 9])
    h0 = rand((6, rows, 24), 45, 0.5)
    c0 = rand((6, rows, 24), 46, 0.5) if cell == "lstm" else None
    eng = CudnnEngine(model)
    try:
        monkeypatch.setattr(engine_module, "plan", padded_plan)
        out = eng.forward(x, lengths, h0, c0, states_needed=False)
    finally:
        eng.close()
    ref = reference_run(model, x, lengths, h0, c0)
    assert out.h_n is None and out.c_n is None
    np.testing.assert_allclose(out.output, ref.output, rtol=RTOL, atol=ATOL)
    assert not out.output[1, 1:].any() and not out.output[4, 2:].any()  # zeros past each length


@gpu
@pytest.mark.parametrize("cell,with_h0,last_only", [("lstm", False, True), ("gru", True, False), ("lstm", True, False)])
def test_chunked_padded_runs_are_exact(monkeypatch, cell, with_h0, last_only):
    """A ragged batch split into its longest rows and the rest, each run padded (autotune._two_chunks, forced
    here whatever it costs): outputs equal the reference engine's, zeros past each length, no final states.
    Run three times, so that the chunks' shapes replay graphs."""
    import service.engines.cudnn.engine as engine_module
    import service.engines.cudnn.fused as fused_module
    from service.engines.cudnn.autotune import _two_chunks

    def chunked_plan(table, b, t, lens, pad_ok=False):
        assert pad_ok
        got = _two_chunks(table, b, t, lens, float("inf"))
        assert got is not None and len(got[1]) == 2
        return got[1]

    mod = make_torch(cell, 6, 24, 2, False, seed=53)
    model = model_from_torch(mod, max_batch_size=16)
    rows = model.spec.state_layers
    x, lengths = rand((11, 17, 6), seed=54), np.array([3, 17, 9, 1, 17, 12, 5, 8, 16, 2, 11])
    h0 = rand((11, rows, 24), 55, 0.5) if with_h0 else None
    c0 = rand((11, rows, 24), 56, 0.5) if with_h0 and cell == "lstm" else None
    ref = reference_run(model, x, lengths, h0, c0)
    eng = CudnnEngine(model)
    try:
        monkeypatch.setattr(engine_module, "plan", chunked_plan)
        monkeypatch.setattr(fused_module, "plan", chunked_plan)  # two groups: not a fused call
        for _ in range(3):
            out = eng.forward(x, lengths, h0, c0, states_needed=False, last_only=last_only)
            assert out.h_n is None and out.c_n is None
            if last_only:
                want = ref.output[np.arange(11), lengths - 1]
                np.testing.assert_allclose(out.last, want, rtol=RTOL, atol=ATOL)
            else:
                np.testing.assert_allclose(out.output, ref.output, rtol=RTOL, atol=ATOL)
                assert not out.output[3, 1:].any() and not out.output[0, 3:].any()
        graphs = eng.describe()["cuda_graphs"]
        assert graphs["replays"] >= 2, graphs
    finally:
        eng.close()


@gpu
def test_bidirectional_is_never_padded():
    mod = make_torch("lstm", 6, 16, 1, True, seed=47)
    model = model_from_torch(mod)
    x, lengths = rand((4, 9, 6), seed=48), np.array([9, 2, 5, 9])
    eng = CudnnEngine(model)
    try:
        out = eng.forward(x, lengths, states_needed=False)
    finally:
        eng.close()
    check_all(out, reference_run(model, x, lengths))


@gpu
@pytest.mark.parametrize("layout", ["batch_major", "seq_major"])
@pytest.mark.parametrize("cell,bidirectional,precision", [
    ("lstm", False, "float32"), ("gru", True, "float32"), ("lstm", True, "float16"), ("gru", False, "bfloat16"),
])
def test_last_only_equals_the_host_gather(cell, bidirectional, precision, layout):
    """forward(last_only=True) picks, on the GPU, exactly the rows output_last takes from the full output."""
    from service.scheduler.batching import output_last

    mod = make_torch(cell, 10, 24, 2, bidirectional, seed=7)
    model = model_from_torch(mod, precision=precision, max_batch_size=64)
    x = rand((33, 12, 10), seed=8)
    ragged = np.random.default_rng(9).integers(1, 13, size=33)
    ragged[0], ragged[1] = 1, 12
    eng = CudnnEngine(model, autotune=False, layout=layout)
    try:
        for lengths in (ragged, None, ragged[:1]):
            xs = x[:len(lengths)] if lengths is not None else x
            for states_needed in (True, False):
                full = eng.forward(xs, lengths, states_needed=states_needed)
                last = eng.forward(xs, lengths, states_needed=states_needed, last_only=True)
                assert last.output is None
                lens = lengths if lengths is not None else np.full(len(xs), xs.shape[1])
                want = output_last(model.spec, np.asarray(full.output, np.float32), lens)
                np.testing.assert_array_equal(np.asarray(last.last, np.float32), want)
                if states_needed:
                    np.testing.assert_array_equal(last.h_n, full.h_n)
    finally:
        eng.close()


@gpu
def test_launches_in_flight_together_equal_forward(torch_cuda):
    """launch()/launch_blocks() queue without waiting; waited for out of order, each equals its forward call."""
    mod = make_torch("lstm", 10, 24, 2, seed=11)
    model = model_from_torch(mod, max_batch_size=64)
    x1, x2 = rand((9, 12, 10), seed=12), rand((5, 7, 10), seed=13)
    lens1 = np.array([12, 1, 5, 12, 7, 3, 12, 9, 2])
    eng = CudnnEngine(model, bucket_graphs=False)  # compared bit for bit: every call at its own shape
    try:
        first = eng.launch(x1, lens1, states_needed=False, last_only=True)
        second = eng.launch(x2)
        blocks = eng.launch_blocks(x2[:2])
        blocks.wait()
        second.wait()
        first.wait()
        got1, got2 = first.finish(), second.finish()
        out, finals = blocks.finish()
        want1 = eng.forward(x1, lens1, states_needed=False, last_only=True)
        want2 = eng.forward(x2)
    finally:
        eng.close()
    np.testing.assert_array_equal(got1.last, want1.last)
    np.testing.assert_array_equal(got2.output, want2.output)
    np.testing.assert_array_equal(got2.h_n, want2.h_n)
    check_all(got2, torch_run([mod], x2))
    want_out, want_h, want_c = torch_run([mod], x2[:2])
    check(out, want_out)
    check(finals[0][0].get(), want_h)
    check(finals[0][1].get(), want_c)


@gpu
@pytest.mark.parametrize("layout", ["batch_major", "seq_major"])
def test_no_persist_dynamic_build_while_serving(layout):
    """Builds compile kernels for 0.1-0.7 s: after load a call uses what was built, or STANDARD.

    Sequence-major calls with equal lengths use packed IO; they reuse the padded-IO build."""
    mod = make_torch("lstm", 16, 32, 2, seed=21)
    model = model_from_torch(mod)
    try:
        eng = CudnnEngine(model, algorithm="persist_dynamic", layout=layout)
    except EngineUnavailable as exc:
        pytest.skip(f"cuDNN refuses persist_dynamic here: {exc}")
    try:
        runner = eng._runners[0]
        assert runner.builds_allowed  # forced: still builds (tests and benches time it)
        runner.builds_allowed = False  # what an autotuned engine does after load
        built = dict(runner.dynamic)
        for b in (3, 4, 5):  # 4 is a tuned bucket, 3 and 5 are not
            x = rand((b, 10, 16), seed=30 + b)
            lengths = np.array([10] * b)
            out = eng.forward(x, lengths)
            check_all(out, reference_run(model, x, lengths))
        assert runner.dynamic == built
    finally:
        eng.close()
    auto = CudnnEngine(model_from_torch(mod))
    try:
        assert not any(r.builds_allowed for r in auto._runners)
    finally:
        auto.close()


@gpu
def test_batches_merged_into_lent_pinned_memory_stay_right_with_several_in_flight():
    """The scheduler's path on the GPU: requests merged into the engine's lent pinned blocks
    (input_buffer), three batches launched before the first is collected, blocks reused as
    batches finish; every request's answer equals the float64 reference of that request alone."""
    from service.scheduler import SequenceWork
    from service.scheduler.batching import finish_batch, launch_batch, output_last

    model = model_from_torch(make_torch("lstm", 6, 20, 2, False, seed=31), max_batch_size=16)
    eng = CudnnEngine(model, blocking_sync=True)
    rng = np.random.default_rng(5)
    try:
        assert eng.input_buffer((2, 3, 6)) is not None
        in_flight = []
        for batch in range(12):
            parts = []
            for _ in range(int(rng.integers(2, 6))):
                lengths = rng.integers(3, 30, int(rng.integers(1, 4)))
                x = rand((len(lengths), int(lengths.max()) + 2, 6), seed=1000 * batch + len(parts))
                parts.append(SequenceWork(x, lengths, outputs=frozenset({"output_last", "output"})))
            merged, launched = launch_batch(eng, parts)
            assert eng._staging.blocks.owner(merged.x) is not None  # built in a lent block
            in_flight.append((merged, launched, parts))
            if len(in_flight) == 3:
                merged, launched, parts = in_flight.pop(0)
                launched.wait()
                for part, got in zip(parts, finish_batch(eng, merged, launched, parts)):
                    want = reference_run(model, part.x, part.lengths)
                    check(got["output"], want.output, what="output")
                    check(got["output_last"], output_last(model.spec, want.output, part.lengths), what="last")
        for merged, launched, parts in in_flight:
            launched.wait()
            finish_batch(eng, merged, launched, parts)
        assert len(eng._staging.blocks) <= 8  # blocks were reused, not one per batch
    finally:
        eng.close()
