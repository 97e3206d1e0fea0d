"""The PyTorch loader: every file kind, module layout and bad input, checked against PyTorch's own output."""
from __future__ import annotations

import warnings

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import safetensors.torch  # noqa: E402

import service  # noqa: E402
from service.engines.reference import ReferenceEngine  # noqa: E402
from service.errors import ConversionError, MissingDependency, VerificationError  # noqa: E402
from service.loaders.torch_loader import load_torch  # noqa: E402
from service.loaders.verify import ATOL, RTOL  # noqa: E402

torch.set_num_threads(1)
pytestmark = [pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
              pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")]
nn = torch.nn
I, H, T = 7, 13, 6
CLASSES = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}


def make(cell, layers=1, bidir=False, proj=0, bias=True, i=I, h=H, seed=0):
    torch.manual_seed(seed)
    kw = {"proj_size": proj} if proj else {}
    if cell.startswith("rnn"):
        kw["nonlinearity"] = cell[4:]
    return CLASSES[cell](i, h, num_layers=layers, bidirectional=bidir, bias=bias, batch_first=True, **kw).eval()


def run_torch(mod, x, lengths=None, h0=None, c0=None):
    """PyTorch's output, batch-first and zero-padded, with h_n/c_n as [B, L*D, *] (float64 if mod is double)."""
    dtype = next(mod.parameters()).dtype
    xt = torch.as_tensor(x, dtype=dtype)
    state = None
    if h0 is not None:
        h = torch.as_tensor(h0, dtype=dtype).transpose(0, 1).contiguous()
        state = (h, torch.as_tensor(c0, dtype=dtype).transpose(0, 1).contiguous()) if c0 is not None else h
    with torch.no_grad():
        if lengths is None:
            y, hn = mod(xt, state)
        else:
            packed = nn.utils.rnn.pack_padded_sequence(xt, torch.as_tensor(lengths), batch_first=True,
                                                       enforce_sorted=False)
            y, hn = mod(packed, state)
            y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
    h_n, c_n = hn if isinstance(hn, tuple) else (hn, None)
    return y.numpy(), h_n.transpose(0, 1).numpy(), None if c_n is None else c_n.transpose(0, 1).numpy()


def check(engine, mod, x, lengths=None, h0=None, c0=None, rtol=RTOL, atol=ATOL):
    want = run_torch(mod, x, lengths, h0, c0)
    got = engine.forward(x, lengths, h0, c0)
    np.testing.assert_allclose(got.output, want[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(got.h_n, want[1], rtol=rtol, atol=atol)
    if want[2] is not None:
        np.testing.assert_allclose(got.c_n, want[2], rtol=rtol, atol=atol)


def states(mod, b, rng, dtype=np.float32):
    rows = mod.num_layers * (2 if mod.bidirectional else 1)
    ho = getattr(mod, "proj_size", 0) or mod.hidden_size
    h0 = rng.standard_normal((b, rows, ho)).astype(dtype)
    c0 = rng.standard_normal((b, rows, mod.hidden_size)).astype(dtype) if isinstance(mod, nn.LSTM) else None
    return h0, c0


def save_pt(tmp_path, state_dict, name="model.pt"):
    path = tmp_path / name
    torch.save(state_dict, path)
    return path


# --- numerics against PyTorch ----------------------------------------------------------------------------


@pytest.mark.parametrize("cell,layers,bidir", list(itertools.product(CLASSES, (1, 3), (False, True))))
def test_state_dict_matches_torch(tmp_path, cell, layers, bidir):
    mod = make(cell, layers, bidir)
    model = service.convert(save_pt(tmp_path, mod.state_dict()), cell="rnn_relu" if cell == "rnn_relu" else None)
    blk = model.spec.blocks[0]
    assert (blk.cell, blk.input_size, blk.hidden_size, blk.num_layers, blk.bidirectional) == (cell, I, H, layers, bidir)
    assert model.provenance["verification"]["checked"] is True
    engine = service.create_engine(model, "cpu")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, T, I)).astype(np.float32)
    h0, c0 = states(mod, 3, rng)
    ragged = np.array([T, 1, 4])
    for lengths, with_state in itertools.product((None, ragged), (False, True)):
        check(engine, mod, x, lengths, *((h0, c0) if with_state else (None, None)))


@pytest.mark.parametrize("kind", ["pt", "legacy_pickle", "safetensors", "script", "trace", "checkpoint"])
def test_file_kinds_tight_float64(tmp_path, kind):
    mod = make("lstm", 2, True)
    path = tmp_path / f"model.{'safetensors' if kind == 'safetensors' else 'pt'}"
    if kind == "pt":
        torch.save(mod.state_dict(), path)
    elif kind == "legacy_pickle":
        torch.save(mod.state_dict(), path, _use_new_zipfile_serialization=False)
    elif kind == "safetensors":
        safetensors.torch.save_file(mod.state_dict(), str(path))
    elif kind == "script":
        torch.jit.save(torch.jit.script(mod), str(path))
    elif kind == "trace":
        torch.jit.save(torch.jit.trace(mod, torch.randn(2, 3, I)), str(path))
    else:
        torch.save({"epoch": 3, "optimizer": {"lr": 0.1}, "model_state_dict": mod.state_dict()}, path)
    model = service.convert(path)
    if kind == "checkpoint":
        assert "checkpoint['model_state_dict']" in model.provenance["notes"][0]
    engine = ReferenceEngine(model, dtype=np.float64)
    x = np.random.default_rng(2).standard_normal((5, T, I))
    h0, c0 = states(mod, 5, np.random.default_rng(3), np.float64)
    check(engine, mod.double(), x, np.array([2, T, 1, 5, 3]), h0, c0, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("bidir", [False, True])
def test_projection_odd_batch_and_batch_one(tmp_path, bidir):
    mod = make("lstm", 2, bidir, proj=5)
    model = service.convert(save_pt(tmp_path, mod.state_dict()))
    assert model.spec.blocks[0].proj_size == 5 and model.spec.output_size == (10 if bidir else 5)
    engine = service.create_engine(model, "cpu")
    rng = np.random.default_rng(4)
    for b, lengths in ((5, np.array([T, 1, 3, T, 2])), (1, None), (1, np.array([1]))):
        x = rng.standard_normal((b, T, I)).astype(np.float32)
        h0, c0 = states(mod, b, rng)
        check(engine, mod, x, lengths, h0, c0)
        check(engine, mod, x, lengths)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bias_false_gives_zero_biases(tmp_path, cell):
    mod = make(cell, 2, True, bias=False)
    assert not any("bias" in k for k in mod.state_dict())
    model = service.convert(save_pt(tmp_path, mod.state_dict()))
    assert "no bias" in model.provenance["torch"]["modules"][0]
    x = np.random.default_rng(5).standard_normal((3, T, I)).astype(np.float32)
    check(service.create_engine(model, "cpu"), mod, x, np.array([T, 1, 4]))


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_cell_modules_are_one_layer_blocks(tmp_path, cell):
    torch.manual_seed(6)
    cls = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}.get(cell, nn.RNNCell)
    mod = cls(I, H, nonlinearity=cell[4:]) if cls is nn.RNNCell else cls(I, H)
    model = service.convert(save_pt(tmp_path, {"decoder.cell." + k: v for k, v in mod.state_dict().items()}),
                            cell=cell if cell == "rnn_relu" else None)
    blk = model.spec.blocks[0]
    assert (blk.cell, blk.num_layers, blk.bidirectional) == (cell, 1, False)
    assert model.provenance["selection"] == ["decoder.cell"]
    x = np.random.default_rng(7).standard_normal((3, T, I)).astype(np.float32)
    state = None
    outs = []
    with torch.no_grad():  # unroll the cell: PyTorch's own step function is the reference
        for t in range(T):
            state = mod(torch.from_numpy(x[:, t]), state)
            outs.append((state[0] if cell == "lstm" else state).numpy())
    got = service.create_engine(model, "cpu").forward(x)
    np.testing.assert_allclose(got.output, np.stack(outs, axis=1), rtol=RTOL, atol=ATOL)
    if cell == "lstm":
        np.testing.assert_allclose(got.c_n[:, 0], state[1].numpy(), rtol=RTOL, atol=ATOL)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.embed = nn.Embedding(20, I)
        self.encoder = nn.GRU(I, H, batch_first=True, bidirectional=True)
        self.decoder = nn.Module()
        self.decoder.rnn = nn.LSTM(I, H, num_layers=2, batch_first=True)
        self.decoder.head = nn.Linear(H, 20)


def test_embedded_module_needs_select(tmp_path):
    net = Seq2Seq()
    path = save_pt(tmp_path, {"_model." + k: v for k, v in net.state_dict().items()})
    with pytest.raises(ConversionError, match=r"holds 2 recurrent modules: '_model.encoder' \(nn.GRU: input 7, "
                                              r"hidden 13, 1 layer, bidirectional\); '_model.decoder.rnn' \(nn.LSTM.*"
                                              r"pass --select PREFIX"):
        service.convert(path)
    model = service.convert(path, select="_model.decoder.rnn")
    assert model.provenance["selection"] == ["_model.decoder.rnn"]
    assert (model.spec.blocks[0].cell, model.spec.blocks[0].num_layers) == ("lstm", 2)
    x = np.random.default_rng(9).standard_normal((3, T, I)).astype(np.float32)
    check(service.create_engine(model, "cpu"), net.decoder.rnn, x, np.array([1, T, 3]))
    enc = service.convert(path, select="_model.encoder.")
    check(service.create_engine(enc, "cpu"), net.encoder, x, np.array([1, T, 3]))


def test_torchscript_submodule_keeps_relu(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, I)
            self.rnn = make("rnn_relu", 2)

        def forward(self, x):
            return self.rnn(self.proj(x))[0]

    net = Net()
    path = tmp_path / "net.pt"
    torch.jit.save(torch.jit.script(net), str(path))
    model = service.convert(path)
    assert model.spec.blocks[0].cell == "rnn_relu"
    assert model.provenance["notes"] == [  # no relu/tanh assumption: TorchScript records it
        "only rnn is converted; the file also has tensors of 'proj', which rnnserve does not serve: send what the "
        "first recurrent module reads as 'input', and apply the other modules yourself"]
    x = np.random.default_rng(10).standard_normal((3, T, I)).astype(np.float32)
    check(service.create_engine(model, "cpu"), net.rnn, x, np.array([T, 1, 2]))
    with pytest.raises(ConversionError, match="--cell rnn_tanh contradicts the TorchScript module 'rnn'"):
        service.convert(path, cell="rnn_tanh")


def test_a_state_dict_with_other_modules_says_they_are_not_served(tmp_path):
    """The check against torch rebuilds only the recurrent module, and here the served output has the whole
    model's shape: the note is what tells the user the served model is a part of it."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, I)
            self.rnn = make("lstm", 2)
            self.head = nn.Linear(H, H)

    model = service.convert(save_pt(tmp_path, Net().state_dict()))
    assert [n for n in model.provenance["notes"] if "not serve" in n] == [
        "only rnn is converted; the file also has tensors of 'proj', 'head', which rnnserve does not serve: send what "
        "the first recurrent module reads as 'input', and apply the other modules yourself"]
    alone = service.convert(save_pt(tmp_path, make("lstm", 2).state_dict()))
    assert not [n for n in alone.provenance["notes"] if "not serve" in n]


def test_comma_select_stacks_modules_in_order(tmp_path):
    torch.manual_seed(11)
    rnns = nn.ModuleList([nn.LSTM(I, H, batch_first=True), nn.LSTM(H, H, batch_first=True)])
    path = save_pt(tmp_path, {"rnns." + k: v for k, v in rnns.state_dict().items()})
    with pytest.raises(ConversionError, match=r"--select 'rnns' holds 2 recurrent modules: 'rnns.0' .*'rnns.1' .*"
                                              r"separated by commas"):
        service.convert(path, select="rnns")
    model = service.convert(path, select="rnns.0,rnns.1")
    assert len(model.spec.blocks) == 1 and model.spec.blocks[0].num_layers == 2
    x = np.random.default_rng(12).standard_normal((3, T, I)).astype(np.float32)
    lengths = np.array([T, 1, 4])
    y0 = run_torch(rnns[0], x, lengths)[0]
    want = run_torch(rnns[1], y0, lengths)[0]
    np.testing.assert_allclose(service.create_engine(model, "cpu").forward(x, lengths).output, want,
                               rtol=RTOL, atol=ATOL)


def test_bfloat16_safetensors_without_torch(tmp_path, monkeypatch):
    mod = make("gru", 1, True)
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in mod.state_dict().items()}, str(path))
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    pt = save_pt(tmp_path, {})  # saved first: torch.save imports parts of torch lazily
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a serving box without torch
    model = service.convert(path)
    verification = model.provenance["verification"]
    assert verification["checked"] is False and "torch is not installed" in verification["reason"]
    assert "pip install 'rnnserve[torch]'" in verification["reason"]
    with pytest.raises(MissingDependency, match=r"reading a PyTorch .pt/.pth file .*pip install 'rnnserve\[torch\]'"):
        service.convert(pt)
    monkeypatch.undo()
    x = np.random.default_rng(13).standard_normal((3, T, I)).astype(np.float32)
    check(service.create_engine(model, "cpu"), mod, x, np.array([2, T, 1]))


def test_repository_roundtrip(tmp_path):
    mod = make("gru", 3, True)
    model = service.convert(save_pt(tmp_path, mod.state_dict()))
    model.save(tmp_path / "repo", "m", 1)
    loaded = service.load_model(tmp_path / "repo" / "m")
    assert loaded.spec == model.spec and loaded.provenance["selection"] == ["<root>"]
    assert loaded.provenance["torch"]["file"] == "state dict"
    x = np.random.default_rng(14).standard_normal((1, T, I)).astype(np.float32)
    check(service.create_engine(loaded, "cpu"), mod, x, np.array([4]))


# --- bad input --------------------------------------------------------------------------------------------


def test_select_errors_list_candidates(tmp_path):
    net = Seq2Seq()
    path = save_pt(tmp_path, net.state_dict())
    listing = (r"recurrent modules in 'model.pt': 'encoder' \(nn.GRU.*\); "
               r"'decoder.rnn' \(nn.LSTM: input 7, hidden 13, 2 layers\)")
    with pytest.raises(ConversionError, match=r"--select 'nope' matches no tensor in the file; " + listing):
        service.convert(path, select="nope")
    with pytest.raises(ConversionError, match=r"--select 'embed' has tensors but no recurrent weights; " + listing):
        service.convert(path, select="embed")
    with pytest.raises(ConversionError, match=r"'decoder.rnn.weight_ih_l0' names a tensor, not a module; pass the "
                                              r"module prefix 'decoder.rnn'"):
        service.convert(path, select="decoder.rnn.weight_ih_l0")
    # a module named twice was stacked on itself (silently when its input and hidden sizes agree)
    with pytest.raises(ConversionError, match=r"--select names 'decoder.rnn' more than once; name each"):
        service.convert(path, select="decoder.rnn, decoder.rnn.")


@pytest.mark.parametrize("cell,given,match", [
    ("lstm", "gru", r"--cell gru does not match 'weight_hh_l0' of shape \[52, 13\]: with hidden size 13 "
                    r"that is an LSTM"),
    ("gru", "rnn_relu", r"--cell rnn_relu does not match 'weight_hh_l0' of shape \[39, 13\].*a GRU"),
    ("rnn_tanh", "lstm", r"--cell lstm does not match .*\[13, 13\].*an RNN"),
    ("lstm", "peephole", r"--cell 'peephole' is not known; use one of lstm, gru, rnn_tanh, rnn_relu"),
])
def test_cell_contradicting_shapes(tmp_path, cell, given, match):
    path = save_pt(tmp_path, make(cell).state_dict())
    with pytest.raises(ConversionError, match=match):
        service.convert(path, cell=given)


def test_relu_rnn_state_dict_assumes_tanh_with_a_note(tmp_path):
    model = service.convert(save_pt(tmp_path, make("rnn_relu").state_dict()), verify=False)
    assert model.spec.blocks[0].cell == "rnn_tanh"
    assert "pass --cell rnn_relu" in model.provenance["notes"][0]
    # the check cannot tell relu from tanh here (it rebuilds the module with the assumed one): the note says so
    assert "cannot catch a wrong one" in model.provenance["notes"][0]


def _sd(**changes):
    sd = dict(make("lstm", 2, True).state_dict())
    for key, value in changes.items():
        if value is None:
            del sd[key]
        else:
            sd[key] = value
    return sd


BAD_STATE_DICTS = {
    "unknown_tensor": (_sd(weight_hh_l0_raw=torch.zeros(52, 13)),
                       r"tensor 'weight_hh_l0_raw' in module '<root>' is not a parameter of nn.LSTM/nn.GRU/nn.RNN"),
    "missing_tensor": (_sd(bias_hh_l1_reverse=None), r"module '<root>' has no tensor 'bias_hh_l1_reverse'"),
    "missing_layer": (_sd(**{k: None for k in _sd() if "_l0" in k}), r"has no tensor 'weight_ih_l0'"),
    "inconsistent_layer": (_sd(weight_ih_l1=torch.zeros(52, 13)),
                           r"tensor 'weight_ih_l1' has shape \[52, 13\], expected \[52, 26\] for LSTM with hidden size "
                           r"13; layer 1 reads the 26 features of layer 0"),
    "bad_bias": (_sd(bias_ih_l1=torch.zeros(40)), r"tensor 'bias_ih_l1' has shape \[40\], expected \[52\]"),
    "unknown_cell_shape": (_sd(weight_hh_l0=torch.zeros(26, 13)),
                           r"cannot tell the cell from 'weight_hh_l0' of shape \[26, 13\]: nn.LSTM, nn.GRU and nn.RNN "
                           r"have 4H, 3H or H rows"),
    "integer_tensor": (_sd(weight_ih_l0=torch.zeros(52, 7, dtype=torch.int64)),
                       r"tensor 'weight_ih_l0' has dtype int64; recurrent weights must be floating point"),
    "mixed_cell_and_stack": (_sd(weight_ih=torch.zeros(52, 7)), r"mixes cell names \(weight_ih\) with layer names"),
    "no_rnn": ({"fc.weight": torch.zeros(3, 4)},
               r"no recurrent weights in 'model.pt' \(1 tensors, e.g. 'fc.weight'\): expected names of nn.LSTM"),
}


@pytest.mark.parametrize("case", list(BAD_STATE_DICTS))
def test_bad_state_dicts(tmp_path, case):
    sd, match = BAD_STATE_DICTS[case]
    with pytest.raises(ConversionError, match=match):
        service.convert(save_pt(tmp_path, sd))


def test_parametrized_weights_are_refused(tmp_path):
    mod = make("lstm")
    nn.utils.parametrizations.weight_norm(mod, "weight_hh_l0")
    with pytest.raises(ConversionError, match=r"module '<root>' has parametrized weights \('parametrizations.weight_hh"
                                              r"_l0.original0'\): remove the parametrization"):
        service.convert(save_pt(tmp_path, mod.state_dict()))


def _onnx_bytes():
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph).SerializeToString()


def _bad_files(tmp_path):
    mod = make("lstm")
    good = save_pt(tmp_path, mod.state_dict(), "good.pt").read_bytes()
    torch.save(mod, tmp_path / "whole.pt")
    safetensors.torch.save_file(mod.state_dict(), str(tmp_path / "good.safetensors"))
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated: what a user's older code still does
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(nn.Sequential(make("lstm")), {nn.LSTM}, dtype=torch.qint8)
        torch.save(quantized.state_dict(), tmp_path / "quantized.pt")
        torch.jit.script(quantized).save(str(tmp_path / "quantized_script.pt"))
    return {
        # its advice was "save the weights only: torch.save(model.state_dict())", which is what was done
        "quantized": ((tmp_path / "quantized.pt").read_bytes(), "model.pt",
                      r"holds TorchScript objects \(torch.ScriptObject\), as the state dict of a quantized model "
                      r"does: .*Save the state dict of the model from before quantizing"),
        # it said "no recurrent weights" (its packed weights are no tensors)
        "quantized_script": ((tmp_path / "quantized_script.pt").read_bytes(), "model.pt",
                             r"'model.pt' is a quantized model \(its '0' is "
                             r"torch.ao.nn.quantized.dynamic.modules.rnn.LSTM\)"
                             r": .*Save the state dict of the model from before quantizing"),
        "whole_module": ((tmp_path / "whole.pt").read_bytes(), "model.pt",
                         r"'model.pt' holds pickled Python objects, not only tensors \(it contains torch.nn.modules.rnn"
                         r".LSTM\); rnnserve does not run code from model files. Save the weights only: "
                         r"torch.save\(model.state_dict\(\), 'model.pt'\)"),
        "tensor_not_dict": (None, "model.pt", r"holds a Tensor, not a state dict; save the weights only"),
        "truncated_pt": (good[: len(good) // 2], "model.pt", r"'model.pt' is a truncated or corrupt zip archive"),
        "truncated_safetensors": ((tmp_path / "good.safetensors").read_bytes()[:-10], "model.safetensors",
                                  r"'model.safetensors' is a truncated or corrupt safetensors file"),
        "garbage_safetensors": (b"not a safetensors file at all", "model.safetensors",
                                r"'model.safetensors' is not a valid safetensors file"),
        "onnx_renamed": (_onnx_bytes(), "model.pt", r"'model.pt' is not a PyTorch file: it is an ONNX model; "
                                                    r"convert it with --format onnx"),
        "hdf5_renamed": (b"\x89HDF\r\n\x1a\n" + bytes(64), "model.pth", r"it is an HDF5 file \(Keras .h5\?\)"),
        "empty": (b"", "model.pt", r"'model.pt' is empty \(0 bytes\); save the model again"),
        "pickle_garbage": (b"\x80\x02garbage" * 4, "model.pt", r"'model.pt' could not be read: truncated or corrupt"),
        "zip_not_torch": (None, "model.pt", r"is a zip archive but not a PyTorch file \(no data.pkl\)"),
    }


BAD_FILE_CASES = ["whole_module", "quantized", "quantized_script", "tensor_not_dict", "truncated_pt",
                  "truncated_safetensors", "garbage_safetensors",
                  "onnx_renamed", "hdf5_renamed", "empty", "pickle_garbage", "zip_not_torch"]


@pytest.mark.parametrize("case", BAD_FILE_CASES)
def test_bad_files(tmp_path, case):
    content, name, match = _bad_files(tmp_path)[case]
    path = tmp_path / name
    if case == "tensor_not_dict":
        torch.save(torch.zeros(3), path)
    elif case == "zip_not_torch":
        import zipfile

        with zipfile.ZipFile(path, "w") as z:
            z.writestr("readme.txt", "hello")
    else:
        path.write_bytes(content)
    with pytest.raises(ConversionError, match=match):
        service.convert(path)


def test_unknown_option_is_refused(tmp_path):
    with pytest.raises(ConversionError, match=r"a PyTorch file takes no --opset; it takes --select and --cell"):
        load_torch(save_pt(tmp_path, make("gru").state_dict()), None, None, opset=17)


def test_an_input_size_of_zero_is_refused_before_torch_builds_a_module(tmp_path):
    """Checked with the shapes, so --no-verify (no torch module built) gets the same message."""
    sd = torch.nn.LSTM(4, 8).state_dict()
    sd["weight_ih_l0"] = torch.zeros(32, 0)
    path = save_pt(tmp_path, sd)
    for verify in (True, False):
        with pytest.raises(ConversionError, match=r"'weight_ih_l0' has shape \[32, 0\]: an input size of 0 features"):
            service.convert(path, verify=verify)


def test_a_flipped_byte_in_the_weights_fails_the_zip_checksum(tmp_path):
    """torch.load reads such a file without complaint (and the check against torch reads the same wrong bytes)."""
    mod = torch.nn.LSTM(4, 8)
    path = save_pt(tmp_path, mod.state_dict())
    data = bytearray(path.read_bytes())
    at = data.find(mod.weight_hh_l0.detach().numpy().tobytes()[:16])
    assert at > 0
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=r"is corrupt: its member '.*' fails the zip's checksum"):
        service.convert(path)


# -- TorchScript archives run whole through their own forward (service.loaders.torchscript_check) ----------------

class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(5, 4, batch_first=True)

    def forward(self, x):
        return self.rnn(x * 2.0)[0]


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x):
        return self.rnn(self.rnn(x)[0])[0]


class _LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(5, 4, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.rnn(x)[0][:, -1]


class _TimeFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(5, 6, num_layers=2)

    def forward(self, x):
        return self.rnn(x)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(5, 4, batch_first=True)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _archive(tmp_path, module, how):
    torch.manual_seed(0)
    path = tmp_path / f"{type(module).__name__}_{how}.pt"
    size = next(module.parameters()).shape[1]
    saved = torch.jit.script(module) if how == "script" else torch.jit.trace(module, torch.randn(1, 3, size))
    torch.jit.save(saved, str(path))
    return path


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("module", [_Scaled, _Twice], ids=["scales its input", "calls its GRU twice"])
def test_an_archive_whose_code_does_more_than_its_modules_is_refused(tmp_path, module, how):
    """Its recurrent weights alone verify; its own forward does not give what they give, and the served model
    would answer differently from the archive (by up to 0.9 in the probe that found it)."""
    path = _archive(tmp_path, module().eval(), how)
    with pytest.raises(VerificationError, match="run whole through its own forward.*--no-verify"):
        service.convert(path)
    assert service.convert(path, verify=False).spec.blocks[0].num_layers == 1  # the user's choice, on purpose


# bidirectional: said "last step" as if output_last (whose reverse half is the first step's) matched
@pytest.mark.parametrize("module, compared", [(_LastStep, "forward() (output[:, -1], the output's last step, not "
                                                          "output_last (whose reverse half is the first step's), "
                                                          "batch-first)"),
                                              (_TimeFirst, "forward()[0] (output, time-first)")])
def test_an_archive_whose_forward_is_its_modules_is_compared_whole(tmp_path, module, compared):
    model = service.convert(_archive(tmp_path, module().eval(), "script"))
    assert model.provenance["verification"]["whole_file"] == {
        "ran": True, "runtime": "torch (the archive's own forward)", "compared": [compared]}


def test_an_archive_with_more_modules_runs_but_is_not_compared(tmp_path):
    model = service.convert(_archive(tmp_path, _Head().eval(), "script"))
    assert model.provenance["verification"]["whole_file"]["compared"] == []
    assert any("'head'" in note for note in model.provenance["notes"])


class _Stack(nn.Module):
    """r1 -> (between) -> r2 -> head: the head keeps the archive's outputs from being compared whole."""

    def __init__(self, between: str):
        super().__init__()
        self.between = between
        self.r1 = nn.LSTM(3, 8, batch_first=True)
        self.mid = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.r2 = nn.GRU(8, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        y = self.r1(x)[0]
        if self.between == "scaled":
            y = 3.0 * y
        elif self.between == "linear":
            y = self.mid(y)
        elif self.between == "flipped":
            y = torch.flip(y, [1])
        elif self.between == "dropout":
            y = self.drop(y)
        elif self.between == "parallel":
            y = self.r1(x)[0] + 0.0 * y
        return self.head(self.r2(y)[0])


def _stack_archive(tmp_path, between, how):
    torch.manual_seed(0)
    module = _Stack(between).eval()
    path = tmp_path / f"stack_{between}_{how}.pt"
    torch.jit.save(torch.jit.script(module) if how == "script" else torch.jit.trace(module, torch.randn(1, 3, 3)),
                   str(path))
    return path


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("between, named", [("scaled", "aten::mul"), ("linear", "aten::linear"),
                                            ("flipped", "aten::flip"), ("parallel", "'r1' 2 times")])
def test_a_stack_with_code_between_its_modules_is_refused_though_a_head_hides_it(tmp_path, between, named, how):
    """A head kept the whole archive from being compared, and --select r1,r2 served r1 -> r2 with the code between
    them left out: "verified", 0.05-0.2 away from the archive (found by a probe)."""
    path = _stack_archive(tmp_path, between, how)
    with pytest.raises(VerificationError, match=f"does not run its recurrent modules as the stack.*{named}"):
        service.convert(path, select="r1,r2")
    assert len(service.convert(path, select="r1,r2", verify=False).spec.blocks) == 2  # on purpose
    service.convert(path, select="r1")  # one module: nothing between to check


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("between", ["none", "dropout"])
def test_a_stack_fed_straight_through_is_accepted_beside_a_head(tmp_path, between, how):
    model = service.convert(_stack_archive(tmp_path, between, how), select="r1,r2")
    assert model.provenance["verification"]["whole_file"]["compared"] == []
    assert any("'head'" in note for note in model.provenance["notes"])


def test_a_traced_relu_rnn_is_read_as_relu_from_its_graph(tmp_path):
    """A traced archive keeps no nonlinearity attribute; its graph's aten::rnn_relu says it (was served as tanh)."""
    torch.manual_seed(0)
    mod = nn.RNN(3, 4, nonlinearity="relu", batch_first=True).eval()
    path = tmp_path / "relu.pt"
    torch.jit.save(torch.jit.trace(mod, torch.randn(1, 4, 3)), str(path))
    model = service.convert(path)
    assert model.spec.blocks[0].cell == "rnn_relu"
    assert not any("tanh is assumed" in note for note in model.provenance["notes"])
    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype(np.float32)
    check(ReferenceEngine(model), mod, x)


def test_a_float64_weight_past_float32s_range_is_refused_by_name(tmp_path):
    """It became inf in float32, the check passed (the probe has no zero feature), and the server answered NaN."""
    gru = nn.GRU(2, 3, batch_first=True).double()
    with torch.no_grad():
        gru.weight_ih_l0[2, 0] = 1e39
    with pytest.raises(ConversionError, match=r"input matrix: 1e\+39 at \[2, 0\].*past float32's range"):
        service.convert(save_pt(tmp_path, gru.state_dict()))
    with torch.no_grad():
        gru.weight_ih_l0[2, 0] = float("nan")
    with pytest.raises(ConversionError, match=r"input matrix: nan at \[2, 0\].*must be finite"):
        service.convert(save_pt(tmp_path, gru.state_dict(), "nan.pt"))


def test_a_learned_initial_state_is_named_and_an_extra_tensor_beside_the_weights_is_left_out(tmp_path):
    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.h0 = nn.Parameter(torch.randn(1, 1, 4))

    notes = service.convert(save_pt(tmp_path, WithState().state_dict())).provenance["notes"]
    assert any("'h0' [1, 1, 4] has the shape of an initial state of 'rnn'" in n and "h_0" in n for n in notes), notes
    state = make("lstm").state_dict()
    state["step"] = torch.tensor(5)  # was refused as "not a parameter ... weight norm"
    notes = service.convert(save_pt(tmp_path, state, "step.pt")).provenance["notes"]
    assert any("tensors of 'step'" in n for n in notes), notes


def test_archive_forms_a_classifier_returns_are_compared(tmp_path):
    """cat(h[-2], h[-1]) of a bidirectional LSTM (a classifier's input) was refused as if compared with the last
    step; a returned h is compared, so a scaled input behind it is refused."""
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(5, 6, batch_first=True, bidirectional=True)

        def forward(self, x):
            _, (h, _) = self.rnn(x)
            return torch.cat((h[-2], h[-1]), dim=1)

    class ScaledState(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(5, 6, batch_first=True)

        def forward(self, x):
            return self.rnn(x * 0.5)[1]

    whole = service.convert(_archive(tmp_path, Both().eval(), "script")).provenance["verification"]["whole_file"]
    assert whole["compared"] == ["forward() (both directions' final states, batch-first)"]
    with pytest.raises(VerificationError, match="h_n"):
        service.convert(_archive(tmp_path, ScaledState().eval(), "script"))


def test_a_traced_stack_of_relu_and_tanh_rnns_gets_each_its_own(tmp_path):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.RNN(5, 6, batch_first=True, nonlinearity="relu")
            self.b = nn.RNN(6, 6, batch_first=True)

        def forward(self, x):
            return self.b(self.a(x)[0])[0]

    model = service.convert(_archive(tmp_path, Two().eval(), "trace"), select="a,b")
    assert [b.cell for b in model.spec.blocks] == ["rnn_relu", "rnn_tanh"]
    assert model.provenance["verification"]["whole_file"]["compared"]


@pytest.mark.parametrize("module, compared", [
    (nn.LSTM(5, 4, num_layers=2, batch_first=True), ["forward()[0] (output, batch-first)"]),
    (nn.GRU(5, 4, bidirectional=True), ["forward()[0] (output, time-first)", "forward()[1] (h_n, time-first)"])])
def test_a_scripted_bare_recurrent_module_is_run_whole_through_its_tensor_overload(tmp_path, module, compared):
    """TorchScript saves a scripted nn.LSTM's forward as overloads (forward__0 on tensors, forward__1 on packed
    sequences) and no ``forward``: the check said the archive had no forward and compared nothing whole."""
    model = service.convert(_archive(tmp_path, module.eval(), "script"))
    assert model.provenance["verification"]["whole_file"] == {
        "ran": True, "runtime": "torch (the archive's own forward)", "compared": compared}


def test_a_file_the_user_cannot_read_is_named_as_such(tmp_path, monkeypatch):
    """An unreadable .pt ended in a PermissionError traceback (exit 1); an .onnx one was called truncated or corrupt."""
    import builtins

    path = save_pt(tmp_path, make("lstm").state_dict())
    real = builtins.open

    def refused(file, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(13, "Permission denied")
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refused)
    with pytest.raises(ConversionError, match=r"'.*' cannot be read \(Permission denied\); give your user read "
                                              r"permission on it"):
        service.convert(path)
