"""ONNX loader: every conversion is checked against onnxruntime's own output on the same input."""
from __future__ import annotations

import os
import zipfile
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from service.engines.reference import ReferenceEngine  # noqa: E402
from service.errors import ConversionError, VerificationError  # noqa: E402
from service.loaders import convert  # noqa: E402
from service.loaders.onnx_loader import load_onnx  # noqa: E402
from service.loaders.verify import ATOL, RTOL  # noqa: E402

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _session(model_or_path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    src = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") else str(model_or_path)
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def _ours(path, x, lengths=None, h0=None, c0=None, **kw):
    model = convert(path, format="onnx", **kw)
    return model, ReferenceEngine(model, dtype=np.float64).forward(x.astype(np.float64), lengths, h0, c0)


def _close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# ---- (1) files exported by torch.onnx.export ---------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _export(tmp_path, kind, layers, bidirectional, batch_first, dynamo=False, batch=2, dynamic=False, **kw):
    torch.manual_seed(0)
    module = getattr(torch.nn, kind)(5, 6, num_layers=layers, bidirectional=bidirectional,
                                     batch_first=batch_first, **kw).eval()
    x = torch.randn(batch, 4, 5) if batch_first else torch.randn(4, batch, 5)
    path = tmp_path / f"{kind.lower()}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            axes = {0: torch.export.Dim("B"), 1: torch.export.Dim("T")} if batch_first else \
                {0: torch.export.Dim("T"), 1: torch.export.Dim("B")}
            torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=(axes,) if dynamic else None).save(str(path))
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=["x"],
                              dynamic_axes={"x": {0: "a", 1: "b"}})
    return path, module


@pytest.mark.parametrize("kind,layers,bidirectional,batch_first,kw", [
    ("LSTM", 1, False, False, {}),
    ("LSTM", 3, True, True, {}),
    ("GRU", 1, False, True, {}),
    ("GRU", 3, True, False, {}),
    ("RNN", 1, True, False, {"nonlinearity": "relu"}),
    ("RNN", 3, False, True, {}),
])
def test_torch_export_matches_onnxruntime(tmp_path, kind, layers, bidirectional, batch_first, kw):
    path, _ = _export(tmp_path, kind, layers, bidirectional, batch_first, **kw)
    x = np.random.default_rng(1).standard_normal((3, 6, 5)).astype(np.float32)
    sess = _session(path)
    feed = x if batch_first else x.transpose(1, 0, 2)
    y = sess.run(None, {sess.get_inputs()[0].name: feed})[0]
    expected = y if batch_first else y.transpose(1, 0, 2)
    model, out = _ours(path, x)
    assert model.provenance["verification"]["checked"]  # the ragged probe through onnxruntime agrees too
    assert len(model.spec.blocks) == 1 and model.spec.blocks[0].num_layers == layers
    assert model.spec.blocks[0].is_cudnn
    _close(out.output, expected)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_torch_dynamo_export(tmp_path, kind):
    path, module = _export(tmp_path, kind, 2, True, True, dynamo=True)
    x = np.random.default_rng(2).standard_normal((2, 4, 5)).astype(np.float32)  # dynamo fixes the shape
    sess = _session(path)
    expected = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    _, out = _ours(path, x)
    _close(out.output, expected)


@pytest.mark.parametrize("kind,bidirectional,batch_first", [("LSTM", False, True), ("GRU", True, False),
                                                            ("LSTM", True, False)])
def test_torch_dynamo_export_of_a_batch_of_one(tmp_path, kind, bidirectional, batch_first):
    """A static dynamo export at batch 1 reshapes between layers to [T, 1, D*H] with the numbers written out:
    the 1 is the batch axis, not a new one (the file's own shapes say so); it used to be refused."""
    path, module = _export(tmp_path, kind, 3, bidirectional, batch_first, dynamo=True, batch=1)
    x = np.random.default_rng(3).standard_normal((1, 4, 5)).astype(np.float32)
    sess = _session(path)
    expected = sess.run(None, {sess.get_inputs()[0].name: x if batch_first else x.transpose(1, 0, 2)})[0]
    model, out = _ours(path, x)
    assert model.spec.blocks[0].num_layers == 3 and not model.provenance.get("notes")
    _close(out.output, expected if batch_first else expected.transpose(1, 0, 2))
    bare = onnx.load(str(path))
    del bare.graph.value_info[:]  # other exporters often leave the value shapes out: onnx's inference finds them
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    _close(_ours(tmp_path / "bare.onnx", x)[1].output, out.output)


@pytest.mark.parametrize("kind,bidirectional,batch_first", [("LSTM", True, True), ("GRU", False, True)])
def test_torch_dynamo_export_with_dynamic_axes(tmp_path, kind, bidirectional, batch_first):
    """With dynamic T and B the exporter computes each Reshape's target from Shape ops; the file itself runs in
    onnxruntime at other shapes than the export's, and so does the converted model, without a note about the
    shape arithmetic (Mul) being unserved."""
    path, module = _export(tmp_path, kind, 3, bidirectional, batch_first, dynamo=True, dynamic=True)
    model = convert(path, format="onnx")
    assert model.spec.blocks[0].num_layers == 3 and not model.provenance.get("notes")
    sess = _session(path)
    fixed = sess.get_inputs()[0].shape  # torch specializes some axes (a GRU's T) even when asked not to
    fixed = fixed if batch_first else [fixed[1], fixed[0]]
    for b, t in ((3, 7), (1, 2)):
        b, t = (n if isinstance(n, int) else want for n, want in zip(fixed[:2], (b, t)))
        x = np.random.default_rng(b).standard_normal((b, t, 5)).astype(np.float32)
        feed = x if batch_first else x.transpose(1, 0, 2)
        expected = sess.run(None, {sess.get_inputs()[0].name: feed})[0]
        with torch.no_grad():
            reference = module(torch.from_numpy(feed))[0].numpy()
        got = ReferenceEngine(model, dtype=np.float64).forward(x.astype(np.float64)).output
        _close(got, expected if batch_first else expected.transpose(1, 0, 2))
        _close(got, reference if batch_first else reference.transpose(1, 0, 2))


def test_an_unrolled_recurrence_says_how_to_export_a_node(tmp_path):
    path, _ = _export(tmp_path, "RNN", 1, False, True, dynamo=True)
    with pytest.raises(ConversionError, match=r"no LSTM, GRU or RNN node .*unrolled.*dynamo=False"):
        convert(path, format="onnx")


# ---- (2) hand-built nodes, every attribute and variant -------------------------------------------------------------

def _node_model(op, i=7, h=13, direction="forward", attrs=None, bias=True, peephole=False, states=False,
                layout=0, scale=0.5, seed=0):
    """A one-node graph with X, sequence_lens (and initial_h/c) as graph inputs and random weights."""
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    inits = [numpy_helper.from_array((rng.standard_normal((d, g * h, i)) * scale).astype(np.float32), "W"),
             numpy_helper.from_array((rng.standard_normal((d, g * h, h)) * scale).astype(np.float32), "R")]
    inputs = ["X", "W", "R", "B" if bias else "", "sequence_lens"]
    if bias:
        inits.append(numpy_helper.from_array((rng.standard_normal((d, 2 * g * h)) * scale).astype(np.float32), "B"))
    batch_axis = ["T", "N"] if layout == 0 else ["N", "T"]
    graph_inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, batch_axis + [i]),
                    helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, ["N"])]
    state_shape = [d, "N", h] if layout == 0 else ["N", d, h]
    inputs.append("initial_h" if states else "")
    if states:
        graph_inputs.append(helper.make_tensor_value_info("initial_h", TensorProto.FLOAT, state_shape))
    if op == "LSTM":
        inputs.append("initial_c" if states else "")
        if states:
            graph_inputs.append(helper.make_tensor_value_info("initial_c", TensorProto.FLOAT, state_shape))
        if peephole:
            inits.append(numpy_helper.from_array(rng.standard_normal((d, 3 * h)).astype(np.float32), "P"))
            inputs.append("P")
    while inputs[-1] == "":
        inputs.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, inputs, outputs, hidden_size=h, direction=direction, layout=layout, **(attrs or {}))
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


VARIANTS = {
    "lstm_peephole_bidi": ("LSTM", dict(direction="bidirectional", peephole=True), {"peephole"}),
    "lstm_peephole_forget_clip": ("LSTM", dict(peephole=True, attrs=dict(input_forget=1, clip=0.7), scale=1.5),
                                  {"peephole", "input_forget", "clip"}),
    "lstm_activations": ("LSTM", dict(direction="bidirectional", attrs=dict(
        activations=["HardSigmoid", "ScaledTanh", "Elu", "Sigmoid", "Softsign", "LeakyRelu"],
        activation_alpha=[0.3, 0.8, 0.9, 0.05], activation_beta=[0.45, 1.2])), {"activations"}),
    "lstm_activations_defaults": ("LSTM", dict(attrs=dict(activations=["HardSigmoid", "Tanh", "Softplus"])),
                                  {"activations"}),
    "lstm_reverse_nobias": ("LSTM", dict(direction="reverse", bias=False), {"reverse"}),
    "lstm_layout1_states": ("LSTM", dict(direction="bidirectional", layout=1, states=True), set()),
    "gru_reset_before_bidi": ("GRU", dict(direction="bidirectional"), {"reset_before"}),
    "gru_lbr1_clip_states": ("GRU", dict(attrs=dict(linear_before_reset=1, clip=0.4), states=True, scale=1.5),
                             {"clip"}),
    "gru_activations_reverse": ("GRU", dict(direction="reverse", attrs=dict(
        activations=["HardSigmoid", "Affine"], activation_alpha=[0.25, 0.5], activation_beta=[0.5, 0.1])),
        {"activations", "reverse", "reset_before"}),
    "gru_thresholded_relu": ("GRU", dict(attrs=dict(linear_before_reset=1, activations=["Sigmoid", "ThresholdedRelu"],
                                                    activation_alpha=[0.1])),
                       {"activations"}),
    "rnn_relu_bidi_states": ("RNN", dict(direction="bidirectional", states=True,
                                         attrs=dict(activations=["Relu", "Relu"])), set()),
    "rnn_mixed_clip": ("RNN", dict(direction="bidirectional", scale=1.5, attrs=dict(
        activations=["Tanh", "LeakyRelu"], activation_alpha=[0.0, 0.2], clip=0.6)), {"activations", "clip"}),
    "rnn_reverse_layout1": ("RNN", dict(direction="reverse", layout=1), {"reverse"}),
}


@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_hand_built_variants_match_onnxruntime(tmp_path, case):
    op, kw, expected_variant = VARIANTS[case]
    path = tmp_path / "m.onnx"
    onnx.save(_node_model(op, **kw), str(path))
    # onnxruntime refuses layout=1 ("Batchwise recurrent operations ... are not supported"), so it runs the
    # same node with layout=0; rnnserve reads the layout=1 file.
    reference = _node_model(op, **{**kw, "layout": 0})
    d = 2 if kw.get("direction") == "bidirectional" else 1
    h = 13
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6, 7)).astype(np.float32)
    lengths = np.array([6, 1, 3, 5], np.int32)
    feed = {"X": x.transpose(1, 0, 2), "sequence_lens": lengths}
    h0 = c0 = None
    if kw.get("states"):
        h0 = rng.standard_normal((4, d, h)).astype(np.float32)
        c0 = rng.standard_normal((4, d, h)).astype(np.float32) if op == "LSTM" else None
        feed["initial_h"] = h0.transpose(1, 0, 2)
        if c0 is not None:
            feed["initial_c"] = c0.transpose(1, 0, 2)
    results = _session(reference).run(None, feed)
    y = results[0].transpose(2, 0, 1, 3)  # [T, D, B, H] -> [B, T, D, H]
    past = np.arange(6)[None, :] >= lengths[:, None]
    assert np.all(y[past] == 0)  # onnxruntime zeroes Y past each length, as the engine contract does
    packed, out = _ours(path, x, lengths, h0, c0)
    assert set(packed.spec.blocks[0].variant_names) == expected_variant
    _close(out.output, y.reshape(4, 6, d * h))
    states = [(out.h_n, results[1])] + ([(out.c_n, results[2])] if op == "LSTM" else [])
    for got, ref in states:
        _close(got, ref.transpose(1, 0, 2))


def test_small_batch_of_one(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_node_model("LSTM", i=7, h=13, peephole=True, attrs=dict(clip=2.0)), str(path))
    x = np.random.default_rng(4).standard_normal((1, 5, 7)).astype(np.float32)
    y = _session(path).run(None, {"X": x.transpose(1, 0, 2), "sequence_lens": np.array([5], np.int32)})[0]
    _, out = _ours(path, x)
    _close(out.output, y.transpose(2, 0, 1, 3).reshape(1, 5, 13))


def test_variant_metadata(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_node_model("LSTM", direction="bidirectional", peephole=True, attrs=dict(
        activations=["HardSigmoid", "Tanh", "Tanh"] * 2)), str(path))
    layer = load_onnx(path).layers[0]
    assert layer.variant["activations"][1][0] == {"name": "hard_sigmoid", "alpha": 0.2, "beta": 0.5}
    p = numpy_helper.to_array(onnx.load(str(path)).graph.initializer[-1])  # P [D, 3H] in i, o, f order
    np.testing.assert_array_equal(layer.peephole[1][1], p[1, 26:39])   # row f <- P_f
    np.testing.assert_array_equal(layer.peephole[1][2], p[1, 13:26])   # row o <- P_o


# ---- (3) graphs with more around them, and bad input ------------------------------------------------------------

def _save(tmp_path, nodes, inits, inputs, outputs, name="m.onnx", opset=14):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), str(path))
    return path


def _f(name, shape=None):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _weights(prefix, op, i, h, d=1, seed=0):
    rng = np.random.default_rng(seed)
    g = GATES[op]
    return [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.5, f"{prefix}{n}")
            for n, s in (("W", (d, g * h, i)), ("R", (d, g * h, h)), ("B", (d, 2 * g * h)))]


def test_graph_with_other_ops_and_initializers_as_inputs(tmp_path):
    rng = np.random.default_rng(5)
    proj = numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "proj")
    inits = [proj] + _weights("a", "LSTM", 6, 5, d=2) + _weights("b", "GRU", 10, 3, seed=1)
    nodes = [
        helper.make_node("MatMul", ["X", "proj"], ["emb"]),
        helper.make_node("LSTM", ["emb", "aW", "aR", "aB"], ["y1"], hidden_size=5, direction="bidirectional"),
        helper.make_node("Transpose", ["y1"], ["y1t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["y1t", "shape"], ["y1r"]),
        helper.make_node("GRU", ["y1r", "bW", "bR", "bB"], ["y2"], hidden_size=3, linear_before_reset=1),
        helper.make_node("Squeeze", ["y2", "axes"], ["y2s"]),
        helper.make_node("Relu", ["y2s"], ["out"]),
    ]
    inits += [numpy_helper.from_array(np.array([0, 0, -1], np.int64), "shape"),
              numpy_helper.from_array(np.array([1], np.int64), "axes")]
    # old-style file: every initializer is also listed as a graph input
    inputs = [_f("X", ["T", "N", 4])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    path = _save(tmp_path, nodes, inits, inputs, [_f("out")])
    loaded = load_onnx(path)
    assert loaded.selection == ["LSTM_0", "GRU_0"]
    assert any("MatMul" in n and "Relu" in n for n in loaded.notes)
    model = convert(path)
    assert [b.cell for b in model.spec.blocks] == ["lstm", "gru"]
    assert model.provenance["verification"]["checked"]
    # the converted stack maps 'emb' to 'y2s': check it against onnxruntime on the whole graph
    full = onnx.load(str(path))
    full.graph.output.append(_f("y2s"))
    x = rng.standard_normal((3, 4, 4)).astype(np.float32)
    expected = _session(full).run(["y2s"], {"X": x.transpose(1, 0, 2)})[0].transpose(1, 0, 2)
    emb = x.astype(np.float64) @ numpy_helper.to_array(proj).astype(np.float64)
    _close(ReferenceEngine(model, dtype=np.float64).forward(emb).output, expected)

    with pytest.raises(ConversionError, match="--cell gru does not match node 'LSTM_0'"):
        load_onnx(path, cell="gru")
    assert load_onnx(path, select="GRU_0").selection == ["GRU_0"]
    with pytest.raises(ConversionError, match="node 'MatMul_0' is a MatMul, not an LSTM"):
        load_onnx(path, select="MatMul_0")


def test_recurrent_node_inside_if_subgraph(tmp_path):
    inits = _weights("", "GRU", 7, 13, d=2)
    then_graph = helper.make_graph(
        [helper.make_node("GRU", ["X", "W", "R", "B"], ["y"], hidden_size=13, direction="bidirectional", name="enc")],
        "then", [], [_f("y")])
    else_graph = helper.make_graph([helper.make_node("Identity", ["X"], ["z"])], "else", [], [_f("z")])
    node = helper.make_node("If", ["cond"], ["out"], then_branch=then_graph, else_branch=else_graph)
    path = _save(tmp_path, [node], inits, [_f("X", ["T", "N", 7]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [_f("out")])
    x = np.random.default_rng(6).standard_normal((2, 5, 7)).astype(np.float32)
    y = _session(path).run(None, {"X": x.transpose(1, 0, 2), "cond": np.array(True)})[0]
    model, out = _ours(path, x)
    assert model.provenance["selection"] == ["enc"]
    assert model.spec.blocks[0].variant_names == ["reset_before"]
    _close(out.output, y.transpose(2, 0, 1, 3).reshape(2, 5, 26))


def _external_model(tmp_path):
    inits = _weights("", "LSTM", 7, 13)
    node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["Y"], hidden_size=13)
    model = helper.make_model(helper.make_graph([node], "g", [_f("X", ["T", "N", 7])], [_f("Y")], inits),
                              opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(model, str(folder / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    return folder / "m.onnx"


def test_external_data(tmp_path):
    path = _external_model(tmp_path)
    x = np.random.default_rng(7).standard_normal((2, 5, 7)).astype(np.float32)
    y = _session(path).run(None, {"X": x.transpose(1, 0, 2)})[0]
    _, out = _ours(path, x)
    _close(out.output, y.transpose(2, 0, 1, 3).reshape(2, 5, 13))


def _relocate(path, location):
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(path))


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_external_data_outside_the_folder_is_refused(tmp_path, how):
    path = _external_model(tmp_path)
    outside = tmp_path / "outside.bin"
    os.replace(path.parent / "weights.bin", outside)
    location = {"parent": "../outside.bin", "absolute": str(outside), "symlink": "link.bin"}[how]
    if how == "symlink":
        os.symlink(outside, path.parent / "link.bin")
    _relocate(path, location)
    with pytest.raises(ConversionError, match="outside the model's folder"):
        load_onnx(path)


def test_truncated_external_data_is_refused(tmp_path):
    path = _external_model(tmp_path)
    data = path.parent / "weights.bin"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ConversionError, match="truncated"):
        load_onnx(path)


@pytest.mark.parametrize("content", [b"not an onnx file at all \x00\xff" * 3, "truncated"])
def test_corrupt_file_is_refused(tmp_path, content):
    path = tmp_path / "m.onnx"
    if content == "truncated":
        onnx.save(_node_model("LSTM"), str(path))
        content = path.read_bytes()[:700]
    path.write_bytes(content)
    with pytest.raises(ConversionError, match="truncated or corrupt|holds no ONNX graph"):
        load_onnx(path)


def test_selection_errors(tmp_path):
    a = _weights("a", "LSTM", 4, 3)
    b = _weights("b", "GRU", 4, 3, seed=1)
    nodes = [helper.make_node("LSTM", ["X", "aW", "aR", "aB"], ["y1"], hidden_size=3),
             helper.make_node("GRU", ["X", "bW", "bR", "bB"], ["y2"], hidden_size=3, name="side")]
    path = _save(tmp_path, nodes, a + b, [_f("X", ["T", "N", 4])], [_f("y1"), _f("y2")])
    with pytest.raises(ConversionError, match=r"separate chains \(LSTM_0; side\).*--select"):
        load_onnx(path)
    # an op between two layers keeps them apart: the message names it (it named only the chains)
    between = [helper.make_node("LSTM", ["X", "aW", "aR", "aB"], ["y1"], hidden_size=3),
               helper.make_node("Squeeze", ["y1", "ax"], ["s1"]), helper.make_node("Relu", ["s1"], ["r1"], name="act"),
               helper.make_node("GRU", ["r1", "bW", "bR", "bB"], ["y2"], hidden_size=3, name="next")]
    b3 = _weights("b", "GRU", 3, 3, seed=1)
    axis = [numpy_helper.from_array(np.array([1], np.int64), "ax")]
    (tmp_path / "apart").mkdir()
    apart = _save(tmp_path / "apart", between, a + b3 + axis, [_f("X", ["T", "N", 4])], [_f("y2")])
    with pytest.raises(ConversionError, match=r"separate chains \(LSTM_0; next\); 'next' reads its input from "
                                              r"Relu 'act', which is no layer rnnserve serves\."):
        load_onnx(apart)
    listing = r"names no node; recurrent nodes: LSTM_0 \(LSTM\), side \(GRU\).*<op>_<k>"
    with pytest.raises(ConversionError, match=listing):
        load_onnx(path, select=" , ")
    with pytest.raises(ConversionError, match="no node named 'LSTM_1'"):
        load_onnx(path, select="LSTM_1")
    assert load_onnx(path, select="side").layers[0].cell == "gru"
    with pytest.raises(ConversionError, match="names 'side' more than once"):
        load_onnx(path, select="side,side")


def test_bidirectional_output_reshaped_wrongly_is_not_a_stack(tmp_path):
    a = _weights("a", "LSTM", 4, 3, d=2)
    b = _weights("b", "LSTM", 6, 3, seed=1)
    nodes = [helper.make_node("LSTM", ["X", "aW", "aR", "aB"], ["y1"], hidden_size=3, direction="bidirectional"),
             helper.make_node("Reshape", ["y1", "shape"], ["y1r"]),   # [T, D, B, H] -> [T, D*B?...] without Transpose
             helper.make_node("LSTM", ["y1r", "bW", "bR", "bB"], ["y2"], hidden_size=3)]
    shape = numpy_helper.from_array(np.array([0, -1, 6], np.int64), "shape")
    path = _save(tmp_path, nodes, a + b + [shape], [_f("X", ["T", "N", 4])], [_f("y2")])
    with pytest.raises(ConversionError, match="reads the output of 'LSTM_0', but not as a plain layer stack"):
        load_onnx(path)


def _shape_computed_stack(tmp_path, order):
    """Two LSTM nodes joined as the dynamo exporter joins them with dynamic axes: Transpose, then Reshape to a
    target built from Shape of the transposed Y ([T, B, D, H]): its entries ``order`` (indices into that shape;
    a pair is multiplied)."""
    a = _weights("a", "LSTM", 4, 3, d=2)
    b = _weights("b", "LSTM", 6, 3, seed=1)
    consts = [numpy_helper.from_array(np.array([k], np.int64), f"k{k}") for k in range(5)]
    nodes = [helper.make_node("LSTM", ["X", "aW", "aR", "aB"], ["y1"], hidden_size=3, direction="bidirectional"),
             helper.make_node("Transpose", ["y1"], ["y1t"], perm=[0, 2, 1, 3]),
             helper.make_node("Shape", ["y1t"], ["s"])]
    parts = []
    for j, entry in enumerate(order):
        picked = []
        for k in (entry if isinstance(entry, tuple) else (entry,)):
            nodes.append(helper.make_node("Slice", ["s", f"k{k}", f"k{k + 1}"], [f"e{j}_{k}"]))
            picked.append(f"e{j}_{k}")
        if len(picked) == 2:
            nodes.append(helper.make_node("Mul", picked, [f"e{j}"]))
        else:
            nodes.append(helper.make_node("Identity", picked, [f"e{j}"]))
        parts.append(f"e{j}")
    nodes += [helper.make_node("Concat", parts, ["target"], axis=0),
              helper.make_node("Reshape", ["y1t", "target"], ["y1r"]),
              helper.make_node("LSTM", ["y1r", "bW", "bR", "bB"], ["y2"], hidden_size=3)]
    return _save(tmp_path, nodes, a + b + consts, [_f("X", ["T", "N", 4])], [_f("y2")])


def test_a_reshape_target_computed_from_shapes_is_followed(tmp_path):
    path = _shape_computed_stack(tmp_path, [0, 1, (2, 3)])
    x = np.random.default_rng(4).standard_normal((3, 5, 4)).astype(np.float32)
    sess = _session(path)
    expected = sess.run(None, {"X": x.transpose(1, 0, 2)})[0]  # [T, 1, B, H]
    model, out = _ours(path, x)
    assert sum(blk.num_layers for blk in model.spec.blocks) == 2 and not model.provenance.get("notes")
    _close(out.output, expected[:, 0].transpose(1, 0, 2))
    with pytest.raises(ConversionError, match="moves the time or batch axis"):
        load_onnx(_shape_computed_stack(tmp_path, [1, 0, (2, 3)]))  # T and B swapped: not a stack


def test_non_constant_weights_are_refused(tmp_path):
    w, r, b = _weights("", "LSTM", 4, 3)
    nodes = [helper.make_node("Mul", ["Wraw", "scale"], ["W"]),
             helper.make_node("LSTM", ["X", "W", "R", "B"], ["y"], hidden_size=3)]
    path = _save(tmp_path, nodes, [r, b], [_f("X", ["T", "N", 4]), _f("Wraw", [1, 12, 4]), _f("scale", [])], [_f("y")])
    with pytest.raises(ConversionError, match="input W .* of node 'LSTM_0' is not a constant: it is computed from "
                                              "graph input 'Wraw'"):
        load_onnx(path)


def test_weights_folded_from_constants(tmp_path):
    # TorchScript export without constant folding reorders gates in the graph: Slice/Concat of initializers.
    w, r, b = _weights("", "GRU", 4, 3)
    half = numpy_helper.from_array(np.asarray(numpy_helper.to_array(b)[:, :9]), "Bhalf")
    nodes = [helper.make_node("Constant", [], ["Wc"], value=w),
             helper.make_node("Identity", ["R"], ["Ri"]),
             helper.make_node("Concat", ["Bhalf", "Bhalf"], ["Bc"], axis=1),
             helper.make_node("GRU", ["X", "Wc", "Ri", "Bc"], ["y"], hidden_size=3)]
    path = _save(tmp_path, nodes, [r, half], [_f("X", ["T", "N", 4])], [_f("y")])
    model = convert(path)
    assert model.provenance["verification"]["checked"]


def test_unknown_activation_is_refused(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_node_model("GRU", attrs=dict(activations=["Sigmoid", "Gelu"])), str(path))
    with pytest.raises(ConversionError, match="activation 'Gelu', which rnnserve does not know"):
        load_onnx(path)


def test_constant_nonzero_initial_state_is_refused(tmp_path):
    w, r, b = _weights("", "LSTM", 4, 3)
    zeros = numpy_helper.from_array(np.zeros((1, 2, 3), np.float32), "h0")
    ones = numpy_helper.from_array(np.ones((1, 2, 3), np.float32), "c0")
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "", "h0", "c0"], ["y"], hidden_size=3)
    path = _save(tmp_path, [node], [w, r, b, zeros, ones], [_f("X", ["T", 2, 4])], [_f("y")])
    with pytest.raises(ConversionError, match="constant nonzero initial_c .*per request \\(h_0/c_0\\)"):
        load_onnx(path)


def test_batch_first_chain_and_runtime_state_inputs(tmp_path):
    # layout=1 nodes: Y [B, T, D, H] -> Reshape [0, 0, -1] -> next node's X [B, T, D*H]
    a = _weights("a", "GRU", 4, 3, d=2)
    b = _weights("b", "GRU", 6, 3, seed=1)
    nodes = [helper.make_node("GRU", ["X", "aW", "aR", "aB", "", "h0"], ["y1"], hidden_size=3, layout=1,
                              direction="bidirectional", linear_before_reset=1),
             helper.make_node("Reshape", ["y1", "shape"], ["y1r"]),
             helper.make_node("GRU", ["y1r", "bW", "bR", "bB"], ["y2"], hidden_size=3, layout=1, linear_before_reset=1)]
    shape = numpy_helper.from_array(np.array([0, 0, -1], np.int64), "shape")
    path = _save(tmp_path, nodes, a + b + [shape], [_f("X", ["N", "T", 4]), _f("h0", ["N", 2, 3])], [_f("y2")])
    loaded = load_onnx(path)
    assert loaded.selection == ["GRU_0", "GRU_1"]
    assert any("initial_h comes from graph input 'h0'" in n for n in loaded.notes)
    model = convert(path)  # verified through onnxruntime with layout=0 copies of the nodes
    assert model.provenance["verification"]["checked"]
    assert [b.bidirectional for b in model.spec.blocks] == [True, False]


def test_state_expanded_from_a_nonzero_constant_is_refused(tmp_path):
    w, r, b = _weights("", "GRU", 4, 3)
    nodes = [helper.make_node("Shape", ["X"], ["xs"]),
             helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.full((1, 1, 3), 0.5,
                                                                                                np.float32))),
             helper.make_node("Gather", ["xs", "one"], ["batch"]),
             helper.make_node("Concat", ["d1", "batch", "h3"], ["shape"], axis=0),
             helper.make_node("Expand", ["half", "shape"], ["h0"]),
             helper.make_node("GRU", ["X", "W", "R", "B", "", "h0"], ["y"], hidden_size=3)]
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("one", [1]), ("d1", [1]), ("h3", [3]))]
    path = _save(tmp_path, nodes, [w, r, b] + consts, [_f("X", ["T", "N", 4])], [_f("y")])
    with pytest.raises(ConversionError, match="nonzero initial_h .* built inside the graph"):
        load_onnx(path)


def test_constant_sequence_lens_is_refused(tmp_path):
    """The served model takes lengths per request: a length fixed in the file would be lost without a word."""
    w, r, b = _weights("", "LSTM", 4, 3)
    lens = numpy_helper.from_array(np.array([2], np.int32), "sl")
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "sl"], ["y"], hidden_size=3)
    path = _save(tmp_path, [node], [w, r, b, lens], [_f("X", ["T", 1, 4])], [_f("y")])
    with pytest.raises(ConversionError, match=r"constant sequence_lens \('sl' = \[2\]\).*per request"):
        load_onnx(path)


@pytest.mark.parametrize("hidden,problem", [(None, "has no hidden_size attribute"), (0, "hidden_size=0"),
                                            (-3, "hidden_size=-3")])
def test_a_missing_or_bad_hidden_size_is_refused(tmp_path, hidden, problem):
    """onnxruntime refuses such a node, so its weights' shapes must not stand in for the attribute."""
    w, r, b = _weights("", "GRU", 4, 3)
    attrs = {} if hidden is None else {"hidden_size": hidden}
    node = helper.make_node("GRU", ["X", "W", "R", "B"], ["y"], **attrs)
    path = _save(tmp_path, [node], [w, r, b], [_f("X", ["T", 1, 4])], [_f("y")])
    with pytest.raises(ConversionError, match=problem):
        load_onnx(path)


def test_a_node_onnxruntime_cannot_run_fails_verification_in_one_message(tmp_path):
    """The loader reads weights, not every attribute: an attribute ONNX does not define is onnxruntime's to refuse,
    and its refusal becomes the conversion's error, not a traceback."""
    from service.errors import VerificationError

    w, r, b = _weights("", "LSTM", 4, 3)
    node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["y"], hidden_size=3, foo=3)
    path = _save(tmp_path, [node], [w, r, b], [_f("X", ["T", "N", 4])], [_f("y")])
    with pytest.raises(VerificationError, match="onnx's own runtime could not run the source model .*foo"):
        convert(path)


def test_keras_options_and_other_formats_are_named(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.onnx"
    onnx.save(_node_model("GRU"), str(path))
    with pytest.raises(ConversionError, match="an ONNX file takes no --recurrent-activation"):
        load_onnx(path, recurrent_activation="hard_sigmoid")
    saved = tmp_path / "lstm.onnx"
    torch.save(torch.nn.LSTM(3, 4).state_dict(), saved)
    with pytest.raises(ConversionError, match="not an ONNX model but a zip archive .*--format torch"):
        load_onnx(saved)
    # each loader names what a file of another format is, and the --format that reads it
    import safetensors.numpy
    from service.loaders.keras_files import read_keras_file

    keras_zip = tmp_path / "k.onnx"
    with zipfile.ZipFile(keras_zip, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("model.weights.h5", b"")
    with pytest.raises(ConversionError, match="not an ONNX model but a Keras .keras archive; .*--format keras"):
        load_onnx(keras_zip)
    tensors = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"weight_ih_l0": np.zeros((16, 3), np.float32)}, str(tensors))
    with pytest.raises(ConversionError, match="not an ONNX model but a safetensors file; .*--format torch"):
        load_onnx(tensors)
    with pytest.raises(ConversionError, match="not a Keras file but an ONNX model; .*--format onnx"):
        read_keras_file(path)
    with pytest.raises(ConversionError, match="not a Keras file but a safetensors file; .*--format torch"):
        read_keras_file(tensors)


# ---- (5) the whole file runs in onnxruntime, beside its rebuilt recurrent nodes --------------------------------------

def test_torch_dynamo_export_of_proj_size_is_checked_on_the_whole_file(tmp_path):
    """torch 2.13's dynamo exporter writes an nn.LSTM with proj_size as a plain LSTM of hidden size proj_size (no
    projection) with a cell state of the wrong width: its nodes alone run, the file does not. Whatever the exporter
    writes, the conversion either serves torch's own numbers or is refused, never a different model "verified"."""
    from service.errors import VerificationError

    path, module = _export(tmp_path, "LSTM", 1, False, True, dynamo=True, proj_size=3)
    x = np.random.default_rng(2).standard_normal((2, 4, 5)).astype(np.float32)
    try:
        _session(path).run(None, {_session(path).get_inputs()[0].name: x})
        runs = True
    except Exception:  # noqa: BLE001 - onnxruntime refuses the file this torch writes
        runs = False
    if runs:
        model, got = _ours(path, x)
        with torch.no_grad():
            _close(got.output, module(torch.from_numpy(x))[0].numpy())
    else:
        with pytest.raises(VerificationError, match="onnxruntime cannot run the file 'lstm.onnx' itself .*initial_c"
                                                    ".*proj_size.*--no-verify"):
            convert(path)
        model = convert(path, verify=False)  # the escape the message names
        assert "verification" not in model.provenance


def test_whole_file_outputs_are_compared_with_the_converted_model(tmp_path):
    w, r, b = _weights("", "GRU", 4, 3)
    plain = [helper.make_node("GRU", ["X", "W", "R", "B"], ["y", "yh"], hidden_size=3),
             helper.make_node("Squeeze", ["y", "axes"], ["out"])]
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    path = _save(tmp_path, plain, [w, r, b, axes], [_f("X", ["T", "N", 4])], [_f("out"), _f("yh")])
    whole = convert(path).provenance["verification"]["whole_file"]
    assert whole == {"ran": True, "compared": ["out", "yh"]}

    # the input rounded to float16 on its way to the node: the nodes alone match, the file's own outputs do not
    rounded = [helper.make_node("Cast", ["X"], ["x16"], to=TensorProto.FLOAT16),
               helper.make_node("Cast", ["x16"], ["x32"], to=TensorProto.FLOAT),
               helper.make_node("GRU", ["x32", "W", "R", "B"], ["y"], hidden_size=3),
               helper.make_node("Squeeze", ["y", "axes"], ["out"])]
    path = _save(tmp_path, rounded, [w, r, b, axes], [_f("X", ["T", "N", 4])], [_f("out")], name="r.onnx")
    from service.errors import VerificationError

    with pytest.raises(VerificationError, match="onnxruntime's output 'out' of the whole file 'r.onnx' does not "
                                                "match the converted model"):
        convert(path)

    # a head after the stack: the file has to run, and its outputs are not the served model's
    head = numpy_helper.from_array(np.ones((3, 2), np.float32), "head")
    with_head = plain[:2] + [helper.make_node("MatMul", ["out", "head"], ["logits"])]
    path = _save(tmp_path, with_head, [w, r, b, axes, head], [_f("X", ["T", "N", 4])], [_f("logits")],
                 name="h.onnx")
    assert convert(path).provenance["verification"]["whole_file"] == {"ran": True, "compared": []}


def test_a_cast_that_truncates_is_not_passed_over_as_a_shape_op(tmp_path):
    """A Cast to int and back changes values. Passed over as a shape op, X -> Cast(INT32) -> Cast(FLOAT) -> LSTM
    -> MatMul converted as if the casts were not there (the head kept the whole file from being compared), and
    served answers 0.4 off; between two LSTMs the same made them one stack. Casts to float types keep one stack
    (an fp16 converter's LSTM kept in float32 between Cast(FLOAT16) and Cast(FLOAT))."""
    head = numpy_helper.from_array(np.ones((3, 2), np.float32), "head")
    to_int = [helper.make_node("Cast", ["X"], ["xi"], to=TensorProto.INT32),
              helper.make_node("Cast", ["xi"], ["xf"], to=TensorProto.FLOAT)]
    nodes = to_int + [helper.make_node("LSTM", ["xf", "W", "R", "B"], ["y", "yh"], hidden_size=3, name="l0"),
                      helper.make_node("MatMul", ["yh", "head"], ["logits"])]
    path = _save(tmp_path, nodes, _weights("", "LSTM", 4, 3) + [head], [_f("X", ["T", "N", 4])], [_f("logits")])
    notes = convert(path).provenance["notes"]
    assert any("the graph also has Cast, MatMul, which rnnserve does not serve" in n for n in notes), notes
    # after the stack too (a version of this fix served it unnoted and unchecked): with no other op the file's
    # outputs are compared, and refused; with a head, noted
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    out_int = [helper.make_node("LSTM", ["X", "W", "R", "B"], ["y"], hidden_size=3, name="l0"),
               helper.make_node("Squeeze", ["y", "axes"], ["s"]),
               helper.make_node("Cast", ["s"], ["si"], to=TensorProto.INT32),
               helper.make_node("Cast", ["si"], ["out"], to=TensorProto.FLOAT)]
    path = _save(tmp_path, out_int, _weights("", "LSTM", 4, 3) + [axes], [_f("X", ["T", "N", 4])], [_f("out")],
                 name="o.onnx")
    with pytest.raises(VerificationError, match="output 'out' of the whole file 'o.onnx' does not match"):
        convert(path)
    out_int.append(helper.make_node("MatMul", ["out", "head"], ["logits"]))
    path = _save(tmp_path, out_int, _weights("", "LSTM", 4, 3) + [axes, head], [_f("X", ["T", "N", 4])],
                 [_f("logits")], name="oh.onnx")
    assert any("the graph also has Cast, MatMul" in n for n in convert(path).provenance["notes"])
    # before the stack with no other op: compared, and refused
    path = _save(tmp_path, nodes[:3], _weights("", "LSTM", 4, 3), [_f("X", ["T", "N", 4])], [_f("y")], name="x.onnx")
    with pytest.raises(VerificationError, match="output 'y' of the whole file 'x.onnx' does not match"):
        convert(path)
    # between two nodes: two chains, not one stack
    link = [helper.make_node("LSTM", ["X", "aW", "aR", "aB"], ["y0"], hidden_size=3, name="l0"),
            helper.make_node("Squeeze", ["y0", "axes"], ["s0"]),
            helper.make_node("Cast", ["s0"], ["ci"], to=TensorProto.BOOL),
            helper.make_node("Cast", ["ci"], ["cf"], to=TensorProto.FLOAT),
            helper.make_node("LSTM", ["cf", "bW", "bR", "bB"], ["y"], hidden_size=3, name="l1")]
    inits = _weights("a", "LSTM", 4, 3) + _weights("b", "LSTM", 3, 3, seed=1) + [axes]
    path = _save(tmp_path, link, inits, [_f("X", ["T", "N", 4])], [_f("y")], name="l.onnx")
    with pytest.raises(ConversionError, match="not one stack: .*'l1' reads its input from Cast"):
        convert(path)
    # to float types (double; float16, whose rounding the whole file is checked within): one stack, no note
    for between, name in ((TensorProto.DOUBLE, "d.onnx"), (TensorProto.FLOAT16, "h.onnx")):
        link[2:4] = [helper.make_node("Cast", ["s0"], ["ci"], to=between),
                     helper.make_node("Cast", ["ci"], ["cf"], to=TensorProto.FLOAT)]
        path = _save(tmp_path, link, inits, [_f("X", ["T", "N", 4])], [_f("y")], name=name)
        try:
            model = convert(path)
        except VerificationError as exc:  # float16's rounding between the nodes, checked on the whole file
            assert between == TensorProto.FLOAT16 and "whole file 'h.onnx' does not match" in str(exc)
            continue
        assert len(model.provenance["selection"]) == 2 and not model.provenance["notes"], model.provenance


def test_a_recurrent_node_inside_a_loop_body_is_refused(tmp_path):
    """The Loop applies the LSTM 3 times; it was served applied once, with only a note that the graph has a Loop."""
    h = 4
    body = helper.make_graph(
        [helper.make_node("LSTM", ["xin", "W", "R"], ["yl"], hidden_size=h, name="lb"),
         helper.make_node("Squeeze", ["yl", "ax"], ["xo"]), helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), _f("xin")],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _f("xo")])
    inits = _weights("", "LSTM", h, h)[:2] + [numpy_helper.from_array(np.array([1], np.int64), "ax"),
                                              numpy_helper.from_array(np.array(3, np.int64), "M"),
                                              numpy_helper.from_array(np.array(True), "go")]
    loop = helper.make_node("Loop", ["M", "go", "X"], ["y"], body=body, name="repeat")
    path = _save(tmp_path, [loop], inits, [_f("X", ["T", "N", h])], [_f("y")], opset=13)
    with pytest.raises(ConversionError, match="node 'lb' is inside the body of Loop 'repeat', which applies it once "
                                              "per iteration.*--select lb"):
        convert(path)
    # picked on purpose (a decoder's step, which the client repeats): served, and noted
    notes = convert(path, select="lb", verify=False).provenance["notes"]
    assert any("inside the body of Loop 'repeat'" in n and "repeat it yourself" in n for n in notes), notes


def test_a_file_onnxruntime_has_no_kernel_for_is_checked_on_its_nodes(tmp_path):
    """onnxruntime runs no recurrent node with layout=1: valid ONNX it lacks, so the rebuilt nodes carry the check."""
    w, r, b = _weights("", "LSTM", 4, 3)
    node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["y"], hidden_size=3, layout=1)
    path = _save(tmp_path, [node], [w, r, b], [_f("X", ["N", "T", 4])], [_f("y")])
    ver = convert(path).provenance["verification"]
    assert ver["checked"] and ver["whole_file"]["ran"] is False
    assert "layout" in ver["whole_file"]["reason"]


def test_a_probe_with_guessed_sizes_that_does_not_run_leaves_the_check_to_the_nodes(tmp_path):
    """A graph input whose size the file ties to nothing rnnserve knows (lengths of a batch axis named apart from
    X's) is fed a guess; when that probe fails the file is not called broken."""
    w, r, b = _weights("", "GRU", 4, 3)
    node = helper.make_node("GRU", ["X", "W", "R", "B", "lens"], ["y"], hidden_size=3)
    lens = helper.make_tensor_value_info("lens", TensorProto.INT32, ["M"])
    path = _save(tmp_path, [node], [w, r, b], [_f("X", ["T", "N", 4]), lens], [_f("y")])
    ver = convert(path).provenance["verification"]
    assert ver["checked"] and ver["whole_file"]["ran"] is False
    assert "may not fit the file" in ver["whole_file"]["reason"] and "lens" in ver["whole_file"]["reason"]



def test_state_inputs_exported_at_a_fixed_batch_are_checked_at_that_batch(tmp_path):
    """torch.onnx.export (dynamo=False) of a module taking h0 with dynamic axes on x only: h0 keeps the example's
    batch. The probe's first batch for x does not fit it (that is the probe's doing; the file was refused as
    broken): the probe takes h0's batch next, and the whole file runs and is compared."""
    torch.manual_seed(0)

    class WithState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(4, 6, batch_first=True)

        def forward(self, x, h0):
            return self.rnn(x, h0)[0]

    path = tmp_path / "gru_h0.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(WithState().eval(), (torch.randn(2, 7, 4), torch.zeros(1, 2, 6)), str(path), dynamo=False,
                          input_names=["x", "h0"], dynamic_axes={"x": {0: "batch", 1: "time"}})
    ver = convert(path).provenance["verification"]
    assert ver["checked"] and ver["whole_file"]["ran"] is True and ver["whole_file"]["compared"], ver


def test_inputs_of_other_types_are_fed_their_own_type(tmp_path):
    w, r, b = _weights("", "LSTM", 4, 3)
    node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["y"], hidden_size=3)
    flag = helper.make_tensor_value_info("flag", TensorProto.UINT8, [1])  # read by nothing the stack needs
    path = _save(tmp_path, [node], [w, r, b], [_f("X", ["T", "N", 4]), flag], [_f("y")])
    assert convert(path).provenance["verification"]["whole_file"] == {"ran": True, "compared": ["y"]}


def test_a_gather_on_the_input_before_the_stack_is_named_as_not_served(tmp_path):
    """X reversed in time by a Gather before the LSTM: Gather counted as shape plumbing, so the model served
    (which does not reverse time) was converted with no note and nothing compared."""
    w, r, b = _weights("", "LSTM", 4, 3)
    steps = numpy_helper.from_array(np.arange(4, dtype=np.int64)[::-1].copy(), "steps")
    nodes = [helper.make_node("Gather", ["X", "steps"], ["xr"], axis=0),
             helper.make_node("LSTM", ["xr", "W", "R", "B"], ["y"], hidden_size=3)]
    path = _save(tmp_path, nodes, [w, r, b, steps], [_f("X", [4, "N", 4])], [_f("y")])
    model = convert(path)
    assert any("also has Gather, which rnnserve does not serve" in n for n in model.provenance["notes"])
    assert model.provenance["verification"]["whole_file"] == {"ran": True, "compared": []}


def test_per_layer_slices_of_state_inputs_are_not_called_unserved(tmp_path):
    """A 2-layer LSTM exported with h and c inputs: the exporter slices them per layer. Those Slices split what
    h_0/c_0 give, so they are served; only ops on the way to the stack's X change what it reads."""
    torch.manual_seed(0)

    class WithStates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 6, 2, batch_first=True)

        def forward(self, x, h, c):
            return self.rnn(x, (h, c))[0]

    path = tmp_path / "lstm_states.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(WithStates().eval(), (torch.randn(2, 7, 4), torch.zeros(2, 2, 6), torch.zeros(2, 2, 6)),
                          str(path), dynamo=False, input_names=["x", "h", "c"], dynamic_axes={"x": {0: "b", 1: "t"}})
    model = convert(path)
    assert not any("does not serve" in n for n in model.provenance["notes"]), model.provenance["notes"]
    whole = model.provenance["verification"]["whole_file"]
    assert whole["ran"] is True and whole["compared"], whole


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::torch.jit.TracerWarning")
def test_a_float64_gru_export_onnxruntime_has_no_kernel_for_converts_checked_on_its_nodes(tmp_path):
    """onnxruntime's GRU has no float64 kernel; the file is valid and was refused as "likely invalid"."""
    torch = pytest.importorskip("torch")
    gru = torch.nn.GRU(3, 4, batch_first=True).double().eval()
    path = tmp_path / "gru64.onnx"
    torch.onnx.export(gru, (torch.randn(1, 5, 3, dtype=torch.float64),), str(path), opset_version=17, dynamo=False,
                      input_names=["x"], dynamic_axes={"x": {0: "b", 1: "t"}})
    model = convert(path)
    whole = model.provenance["verification"]["whole_file"]
    assert whole["ran"] is False and "does not support double" in whole["reason"]
    assert model.provenance["verification"]["checked"] is True


@pytest.mark.parametrize("op", ["Tanh", "Neg"])
def test_a_state_or_lengths_computed_from_an_input_is_noted_as_computed_not_as_the_input(tmp_path, op):
    """initial_h = Unsqueeze(op(cond)), sequence_lens = Sub(n, 1): the notes said to send 'cond' as h_0 (answers
    then off by up to 3 against onnxruntime) and said nothing of the lengths. The client must send the values the
    graph computes; the note names the op."""
    w, r, b = _weights("", "GRU", 4, 3)
    nodes = [helper.make_node(op, ["cond"], ["t"]), helper.make_node("Unsqueeze", ["t", "ax0"], ["h0"]),
             helper.make_node("Sub", ["n", "one"], ["lens"]),
             helper.make_node("GRU", ["X", "W", "R", "B", "lens", "h0"], ["y"], hidden_size=3, name="g")]
    consts = [numpy_helper.from_array(np.array([0], np.int64), "ax0"), numpy_helper.from_array(np.array(1, np.int32),
                                                                                               "one")]
    path = _save(tmp_path, nodes, [w, r, b] + consts,
                 [_f("X", ["T", "N", 4]), _f("cond", ["N", 3]), helper.make_tensor_value_info("n", TensorProto.INT32,
                                                                                              ["N"])], [_f("y")])
    notes = load_onnx(path).notes
    assert f"node 'g': initial_h is computed from graph input 'cond' by {op} (node '{op}_0'), which rnnserve does " \
           f"not serve: send the computed value per request as h_0, not 'cond' itself" in notes, notes
    assert "node 'g': sequence_lens is computed from graph input 'n' by Sub (node 'Sub_0'), which rnnserve does not " \
           "serve: send the computed value per request as lengths, not 'n' itself" in notes, notes
    assert not any("comes from graph input" in n for n in notes), notes


def test_a_float16_file_says_its_whole_file_check_was_within_float16_rounding(tmp_path):
    """A float16 file computes in float16: its outputs are compared within 1e-2, and the record says so (it said
    "match" beside the README's 1e-5)."""
    model = _node_model("LSTM", i=3, h=5)
    for init in model.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    path = tmp_path / "half.onnx"
    onnx.save(model, str(path))
    whole = convert(path).provenance["verification"]["whole_file"]
    assert whole["ran"] and whole["compared"] and whole["within"] == "float16's rounding (rtol 0.01, atol 0.01)", whole


def test_a_float16_file_with_float32_inputs_and_outputs_is_checked_within_float16_rounding(tmp_path):
    """onnxconverter-common's float16 conversion with keep_io_types (its recommended form) keeps float32 graph inputs
    and outputs around float16 nodes: X -> Cast(FLOAT16) -> LSTM -> Cast(FLOAT). The file computes in float16, so its
    outputs differ from the converted model by float16's rounding; it was refused as not matching."""
    w, r, b = _weights("", "LSTM", 4, 3)
    half = [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name) for t in (w, r, b)]
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("Cast", ["X"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("LSTM", ["x16", "W", "R", "B"], ["y"], hidden_size=3),
             helper.make_node("Squeeze", ["y", "axes"], ["s"]),
             helper.make_node("Cast", ["s"], ["out"], to=TensorProto.FLOAT)]
    path = _save(tmp_path, nodes, half + [axes], [_f("X", ["T", "N", 4])], [_f("out")])
    whole = convert(path).provenance["verification"]["whole_file"]
    assert whole == {"ran": True, "compared": ["out"], "within": "float16's rounding (rtol 0.01, atol 0.01)"}, whole


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _two_layer_state_graph(tmp_path, picks):
    """Two stacked LSTM nodes (I=4, H=3) whose initial_h come from graph input h [2, N, 3] through ``picks``
    (nodes making 'h_a' and 'h_b', the first and second node's initial_h); c stays zero."""
    a, b = _weights("a", "LSTM", 4, 3), _weights("b", "LSTM", 3, 3, seed=1)
    nodes = picks + [
        helper.make_node("LSTM", ["X", "aW", "aR", "aB", "", "h_a"], ["y1"], hidden_size=3, name="first"),
        helper.make_node("Squeeze", ["y1", "ax1"], ["y1s"]),
        helper.make_node("LSTM", ["y1s", "bW", "bR", "bB", "", "h_b"], ["y2"], hidden_size=3, name="second")]
    consts = [_i64("ax1", [1]), _i64("s0", [0]), _i64("s1", [1]), _i64("s2", [2]), _i64("ax0", [0]),
              _i64("ax2", [2]), _i64("back", [-1]), _i64("end", [-4]), _i64("big", [99]), _i64("swap", [1, 0])]
    return _save(tmp_path, nodes, a + b + consts, [_f("X", ["T", "N", 4]), _f("h", [2, "N", 3])], [_f("y2")])


_PLAIN = [helper.make_node("Slice", ["h", "s0", "s1", "ax0"], ["h_a"]),
          helper.make_node("Slice", ["h", "s1", "s2", "ax0"], ["h_b"])]
_REARRANGED = {
    "layers_swapped": [helper.make_node("Slice", ["h", "s1", "s2", "ax0"], ["h_a"]),
                       helper.make_node("Slice", ["h", "s0", "s1", "ax0"], ["h_b"])],
    "h_reversed_by_a_slice_with_step_minus_1": [
        helper.make_node("Slice", ["h", "back", "end", "ax2", "back"], ["hr"]),
        helper.make_node("Slice", ["hr", "s0", "s1", "ax0"], ["h_a"]),
        helper.make_node("Slice", ["hr", "s1", "s2", "ax0"], ["h_b"])],
    "layers_permuted_by_a_gather": [
        helper.make_node("Gather", ["h", "swap"], ["hg"], axis=0),
        helper.make_node("Slice", ["hg", "s0", "s1", "ax0"], ["h_a"]),
        helper.make_node("Slice", ["hg", "s1", "s2", "ax0"], ["h_b"])],
    "cast_to_int_and_back": [
        helper.make_node("Cast", ["h"], ["hi"], to=TensorProto.INT32),
        helper.make_node("Cast", ["hi"], ["hf"], to=TensorProto.FLOAT),
        helper.make_node("Slice", ["hf", "s0", "s1", "ax0"], ["h_a"]),
        helper.make_node("Slice", ["hf", "s1", "s2", "ax0"], ["h_b"])],
}


def test_a_state_input_split_per_layer_as_it_is_is_checked_on_the_file_and_served_as_sent(tmp_path):
    """The notes say to send 'h' as h_0; the whole file, run with a random 'h', reads it as it is, and the served
    model fed 'h' (as [B, L*D, H]) answers what onnxruntime answers for the file."""
    path = _two_layer_state_graph(tmp_path, list(_PLAIN))
    model = convert(path)
    whole = model.provenance["verification"]["whole_file"]
    assert whole["state_inputs"] == {"as_sent": ["h (initial_h)"], "rearranged": []}, whole
    assert sum("initial_h comes from graph input 'h': send it per request as h_0 [B, 2, H], transposed from "
               "[2, B, 3] as torch exports it" in n for n in model.provenance["notes"]) == 2, model.provenance["notes"]
    rng = np.random.default_rng(3)
    x, h = rng.standard_normal((5, 2, 4)).astype(np.float32), rng.standard_normal((2, 2, 3)).astype(np.float32)
    want = _session(path).run(None, {"X": x, "h": h})[0]  # [T, 1, N, H]
    got = ReferenceEngine(model, dtype=np.float64).forward(x.transpose(1, 0, 2).astype(np.float64), None,
                                                           h.transpose(1, 0, 2).astype(np.float64)).output
    _close(got, want[:, 0].transpose(1, 0, 2))


@pytest.mark.parametrize("case", sorted(_REARRANGED))
def test_a_state_input_reordered_cut_or_rounded_on_its_way_is_not_noted_as_the_input_itself(tmp_path, case):
    """Verification probe H3: these picks were noted "comes from graph input 'h'; send it as h_0" and the conversion
    "verified" (the probe fed zero states), while sending 'h' so gave answers unlike the file's. Now the file runs
    with a random 'h' and the note says to send what the nodes read."""
    path = _two_layer_state_graph(tmp_path, list(_REARRANGED[case]))
    model = convert(path)
    notes = model.provenance["notes"]
    assert not any("comes from graph input 'h'" in n for n in notes), notes
    changed = [n for n in notes if "initial_h is graph input 'h' taken through" in n]
    assert len(changed) == 2 and all("send per request as h_0 the values the node reads, not 'h' itself" in n
                                     for n in changed), notes
    assert model.provenance["verification"]["whole_file"]["state_inputs"] == {
        "as_sent": [], "rearranged": ["h (initial_h)"]}
    # what the note now says is true: 'h' as sent does not give the file's answers
    rng = np.random.default_rng(3)
    x, h = rng.standard_normal((5, 2, 4)).astype(np.float32), rng.standard_normal((2, 2, 3)).astype(np.float32)
    want = _session(path).run(None, {"X": x, "h": h})[0][:, 0].transpose(1, 0, 2)
    got = ReferenceEngine(model, dtype=np.float64).forward(x.transpose(1, 0, 2).astype(np.float64), None,
                                                           h.transpose(1, 0, 2).astype(np.float64)).output
    assert np.max(np.abs(got - want)) > 1e-3


@pytest.mark.parametrize("picks,says", [
    ("plain", "the file, run with random values in its state and lengths inputs, reads h (initial_h) as sent (the "
              "notes say how)"),
    ("layers_swapped", "note: node 'first': initial_h is graph input 'h' taken through Slice 'Slice_0', which do not "
                       "pass it on as it is"),
])
def test_rnnserve_convert_prints_what_the_state_check_found(tmp_path, picks, says):
    import subprocess
    import sys

    path = _two_layer_state_graph(tmp_path, list(_PLAIN if picks == "plain" else _REARRANGED[picks]))
    res = subprocess.run([sys.executable, "-m", "service.cli", "convert", str(path), "--name", "m", "--repository",
                          str(tmp_path / "repo")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and says in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("permuted", [False, True])
def test_lengths_picked_from_an_input_are_checked_on_the_file(tmp_path, permuted):
    """sequence_lens = Gather(n, [1, 0, 2]) reads the lengths of other sequences: sending 'n' as lengths gave wrong
    answers with no note. A plain pick (Identity) is 'n' itself."""
    w, r, b = _weights("", "GRU", 4, 3)
    pick = (helper.make_node("Gather", ["n", "perm"], ["lens"], axis=0) if permuted
            else helper.make_node("Identity", ["n"], ["lens"]))
    nodes = [pick, helper.make_node("GRU", ["X", "W", "R", "B", "lens"], ["y"], hidden_size=3, name="g")]
    path = _save(tmp_path, nodes, [w, r, b, _i64("perm", [1, 0, 2])],
                 [_f("X", ["T", 3, 4]), helper.make_tensor_value_info("n", TensorProto.INT32, [3])], [_f("y")])
    model = convert(path)
    states = model.provenance["verification"]["whole_file"]["state_inputs"]
    notes = model.provenance["notes"]
    if permuted:
        assert states == {"as_sent": [], "rearranged": ["n (sequence_lens)"]}, states
        assert "node 'g': sequence_lens is graph input 'n' taken through Gather 'Gather_0', which do not pass it on " \
               "as it is (the node reads its values reordered, cut, repeated or rounded): send per request as " \
               "lengths the values the node reads, not 'n' itself" in notes, notes
    else:
        assert states == {"as_sent": ["n (sequence_lens)"], "rearranged": []} and not notes, (states, notes)


def test_lengths_declared_float_and_states_declared_integer_convert(tmp_path):
    """Lengths as a float input cast to int, and h as an int input cast to float, are valid files: the whole-file
    probe fed the float lengths zeros and the int state ones, so the file's answers were unlike the converted
    model's (compared at full lengths and zero states) and the file was refused."""
    cast = helper.make_node("Cast", ["lf"], ["lens"], to=TensorProto.INT32)
    path = _one_gru(tmp_path, [cast], [_f("lf", ["N"])], lens="lens", state="")
    model = convert(path)
    whole = model.provenance["verification"]["whole_file"]
    assert whole["ran"] and whole["compared"] == ["y"], whole
    assert whole["state_inputs"] == {"as_sent": ["lf (sequence_lens)"], "rearranged": []}, whole
    cast = helper.make_node("Cast", ["hi"], ["h0"], to=TensorProto.FLOAT)
    path = _one_gru(tmp_path, [cast], [helper.make_tensor_value_info("hi", TensorProto.INT64, [1, "N", 3])])
    model = convert(path)
    whole = model.provenance["verification"]["whole_file"]
    assert whole["ran"] and whole["compared"] == ["y"], whole
    assert "not checked on the file ('hi' is not a float state the probe can vary)" in " ".join(
        model.provenance["notes"]), model.provenance["notes"]


def test_a_state_computed_from_several_inputs_names_them_all(tmp_path):
    """initial_h = Where(cond, h, 0): the note named only 'cond' (the first input found), not 'h'."""
    w, r, b = _weights("", "GRU", 4, 3)
    nodes = [helper.make_node("Where", ["cond", "h", "zero"], ["h0"]),
             helper.make_node("GRU", ["X", "W", "R", "B", "", "h0"], ["y"], hidden_size=3, name="g")]
    zero = numpy_helper.from_array(np.zeros((1, 1, 3), np.float32), "zero")
    path = _save(tmp_path, nodes, [w, r, b, zero],
                 [_f("X", ["T", "N", 4]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [1, "N", 3]),
                  _f("h", [1, "N", 3])], [_f("y")])
    assert "node 'g': initial_h is computed from graph inputs 'cond', 'h' by Where (node 'Where_0'), which rnnserve " \
           "does not serve: send the computed value per request as h_0, not any of them itself" in load_onnx(path).notes


def _one_gru(tmp_path, picks, inputs, lens="", state="h0", d=1, layout=0, x_shape=("T", "N", 4), before_x=()):
    """One GRU node (I=4, H=3, ``d`` directions) fed X (through ``before_x`` nodes making 'xin', if any), reading
    ``lens`` and ``state`` made by ``picks`` from ``inputs``."""
    w, r, b = _weights("", "GRU", 4, 3, d=d)
    x = "xin" if before_x else "X"
    nodes = list(before_x) + list(picks) + [helper.make_node(
        "GRU", [x, "W", "R", "B", lens, state], ["y"], hidden_size=3, name="g", layout=layout,
        direction="bidirectional" if d == 2 else "forward")]
    consts = [_i64("s0", [0]), _i64("s1", [1]), _i64("ax0", [0]), _i64("ax2", [2]), _i64("back", [-1]),
              _i64("end", [-99]), _i64("rev", [2, 1, 0]), _i64("shape", [-1, 2, 3]),
              numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    return _save(tmp_path, nodes, [w, r, b] + consts, [_f("X", list(x_shape))] + inputs, [_f("y")])


def test_state_notes_say_which_rows_and_form_the_input_fills(tmp_path):
    """A state input that fills only one layer's rows, or h_0 batch first, or reshaped: the note says how to send
    it (it said "send it as h_0", which the served model refused, or a client took torch's [L*D, B, H] for it)."""
    # batch first [N, 2, 3] for a bidirectional node: as it is
    bd = _one_gru(tmp_path, [helper.make_node("Transpose", ["h"], ["h0"], perm=[1, 0, 2])], [_f("h", ["N", 2, 3])],
                  d=2)
    assert "node 'g': initial_h comes from graph input 'h': send it per request as h_0 [B, 2, H], as it is (batch " \
           "first)" in convert(bd).provenance["notes"]
    # [N, 6] reshaped per direction
    flat = _one_gru(tmp_path, [helper.make_node("Reshape", ["h", "shape"], ["hr"]),
                               helper.make_node("Transpose", ["hr"], ["h0"], perm=[1, 0, 2])],
                    [_f("h", ["N", 6])], d=2)
    assert "node 'g': initial_h comes from graph input 'h': send it per request as h_0 [B, 2, H], reshaped from " \
           "[B, 6] to [B, 2, 3]" in convert(flat).provenance["notes"]
    # only the second layer's rows
    a, b = _weights("a", "GRU", 4, 3), _weights("b", "GRU", 3, 3, seed=1)
    nodes = [helper.make_node("GRU", ["X", "aW", "aR", "aB"], ["y1"], hidden_size=3, name="first"),
             helper.make_node("Squeeze", ["y1", "ax1"], ["y1s"]),
             helper.make_node("GRU", ["y1s", "bW", "bR", "bB", "", "h"], ["y2"], hidden_size=3, name="second")]
    path = _save(tmp_path, nodes, a + b + [_i64("ax1", [1])], [_f("X", ["T", "N", 4]), _f("h", [1, "N", 3])],
                 [_f("y2")], name="rows.onnx")
    assert "node 'second': initial_h comes from graph input 'h': send it per request as rows 1..1 of h_0 [B, 2, H], " \
           "as it is (batch first); the other rows are what the other layers start from (zeros where the file " \
           "gives them none)" in convert(path).provenance["notes"]


def test_state_notes_that_could_not_be_checked_say_so(tmp_path):
    """Verification probe H1/H2/M3: where the file does not run in onnxruntime (layout=1 nodes), lengths cannot be
    varied (the stack's X is computed, so the probe ran at batch 1) or a state is not a float, a Gather that
    reverses H or the lengths was still noted as the input itself, with nothing saying it was not checked."""
    layout1 = _one_gru(tmp_path, [helper.make_node("Gather", ["h", "rev"], ["h0"], axis=2)],
                       [_f("h", ["N", 1, 3])], layout=1, x_shape=("N", "T", 4))
    model = convert(layout1)
    whole = model.provenance["verification"]["whole_file"]
    assert whole["ran"] is False and whole["state_inputs_unchecked"] == "onnxruntime did not run the file", whole
    assert "node 'g': initial_h comes from graph input 'h'; send it per request as h_0 (zeros when omitted); not " \
           "checked on the file (onnxruntime did not run the file): if Gather 'Gather_0' reorder, cut, repeat or " \
           "round 'h', send the values the node reads instead" in model.provenance["notes"], model.provenance["notes"]

    lengths = _one_gru(tmp_path, [helper.make_node("Slice", ["n", "back", "end", "ax0", "back"], ["lens"])],
                       [helper.make_tensor_value_info("n", TensorProto.INT32, ["N"])], lens="lens", state="",
                       before_x=[helper.make_node("Mul", ["X", "two"], ["xin"])])
    model = convert(lengths)
    assert "node 'g': sequence_lens comes from graph input 'n' through Slice 'Slice_0'; send it per request as " \
           "lengths, not checked on the file (the probe could not give 'n' distinct lengths (it ran at batch or " \
           "time 1))" in " | ".join(model.provenance["notes"]), model.provenance["notes"]

    int_state = _one_gru(tmp_path, [helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT)] + [
        helper.make_node("Gather", ["hf", "rev"], ["h0"], axis=2)],
        [helper.make_tensor_value_info("h", TensorProto.INT32, [1, "N", 3])],
        before_x=[helper.make_node("Mul", ["X", "two"], ["xin"])])
    model = convert(int_state)
    record = model.provenance["verification"]["whole_file"]
    assert record["state_inputs_unchecked"] == "'h' is not a float state the probe can vary", record
    assert any("not checked on the file ('h' is not a float state the probe can vary)" in n
               for n in model.provenance["notes"]), model.provenance["notes"]
