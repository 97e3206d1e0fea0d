"""One ONNX LSTM/GRU/RNN node -> one RecurrentLayer in canonical gate order (layouts.md sections 4 and 7).

Activation parameters follow onnxruntime's CPU kernels, the reference for what an
ONNX file computes (rnn/rnn_helpers.cc; measured on onnxruntime 1.31 for LSTM, GRU
and RNN alike): ``activation_alpha``/``activation_beta`` are consumed in order by
the activations that take them (LeakyRelu, ThresholdedRelu, Elu take alpha; Affine,
ScaledTanh, HardSigmoid take both), with defaults LeakyRelu 0.01, HardSigmoid
0.2/0.5, Elu 1.0 and 0 for the rest. The resolved values are written into the
variant, so the engine never guesses.
"""
from __future__ import annotations

import numpy as np
from onnx import NodeProto

from ..errors import ConversionError
from ..packing import LayerWeights
from .layers import RecurrentLayer
from .onnx_graph import SHAPE_OPS, GraphIndex
from .onnx_state_check import StateClaim

# ONNX gate block order -> canonical order (index into the ONNX blocks, per canonical gate)
_ORDER = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}   # iofc -> ifgo; zrh -> rzn
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
_SNAKE = {
    "sigmoid": "sigmoid", "tanh": "tanh", "relu": "relu", "affine": "affine", "leakyrelu": "leaky_relu",
    "thresholdedrelu": "thresholded_relu", "scaledtanh": "scaled_tanh", "hardsigmoid": "hard_sigmoid",
    "elu": "elu", "softsign": "softsign", "softplus": "softplus",
}
_ONNX_NAMES = ("Affine", "Elu", "HardSigmoid", "LeakyRelu", "Relu", "ScaledTanh", "Sigmoid", "Softplus", "Softsign",
               "Tanh", "ThresholdedRelu")
_USES = {  # (takes alpha, takes beta), onnxruntime rnn_helpers.cc
    "affine": (True, True), "leaky_relu": (True, False), "thresholded_relu": (True, False),
    "scaled_tanh": (True, True), "hard_sigmoid": (True, True), "elu": (True, False),
}
_ORT_DEFAULTS = {"leaky_relu": (0.01, 0.0), "hard_sigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}
_DIRECTIONS = ("forward", "reverse", "bidirectional")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reorder(mat: np.ndarray, op: str, h: int) -> np.ndarray:
    return np.concatenate([mat[k * h:(k + 1) * h] for k in _ORDER[op]], axis=0)


def _activations(index: GraphIndex, node: NodeProto, op: str, d_count: int, name: str,
                 notes: list[str]) -> list[list[dict]]:
    per = len(_DEFAULT_ACTS[op])
    names = [_text(a) for a in (index.attr(node, "activations") or [])]
    if not names:
        names = list(_DEFAULT_ACTS[op]) * d_count
    if op == "RNN" and len(names) == 2 and d_count == 1:
        names = names[:1]   # onnxruntime: the schema's two-entry default on a one-direction node
    if len(names) != per * d_count:
        raise ConversionError(
            f"node '{name}' ({op}, {d_count} direction(s)) has {len(names)} activations; it needs {per * d_count} "
            f"({per} per direction)"
        )
    alphas = [float(a) for a in (index.attr(node, "activation_alpha") or [])]
    betas = [float(b) for b in (index.attr(node, "activation_beta") or [])]
    out: list[dict] = []
    for raw in names:
        snake = _SNAKE.get(raw.lower())
        if snake is None:
            raise ConversionError(
                f"node '{name}' uses activation '{raw}', which rnnserve does not know; supported: "
                f"{', '.join(_ONNX_NAMES)}"
            )
        takes_a, takes_b = _USES.get(snake, (False, False))
        da, db = _ORT_DEFAULTS.get(snake, (0.0, 0.0))
        if snake not in _ORT_DEFAULTS and ((takes_a and not alphas) or (takes_b and not betas)):
            notes.append(f"node '{name}': {raw} is missing activation_alpha/beta values; onnxruntime uses 0 for "
                         f"them, and so does rnnserve")
        alpha = alphas.pop(0) if takes_a and alphas else da
        beta = betas.pop(0) if takes_b and betas else db
        out.append({"name": snake, "alpha": alpha, "beta": beta})
    return [out[k * per:(k + 1) * per] for k in range(d_count)]


def _weight(index: GraphIndex, node: NodeProto, slot: int, label: str, name: str) -> np.ndarray | None:
    if len(node.input) <= slot or not node.input[slot]:
        return None
    value = index.constant(node.input[slot])
    if value is None:
        source = index.depends_on_input(node.input[slot])
        why = f"it is computed from graph input '{source}'" if source else \
            "it is computed by ops rnnserve does not fold"
        raise ConversionError(
            f"input {label} ('{node.input[slot]}') of node '{name}' is not a constant: {why}. "
            f"Recurrent weights must be initializers or Constant nodes"
        )
    if value.dtype.kind != "f":
        raise ConversionError(f"input {label} of node '{name}' has dtype {value.dtype}; weights must be floating point")
    return np.asarray(value, dtype=np.float64)


def _check_lengths(index: GraphIndex, node: NodeProto, name: str, notes: list[str],
                   claims: list[StateClaim] | None) -> None:
    """Refuse a constant ``sequence_lens``: the served model takes lengths per request, so the file's would be lost.
    Lengths the graph computes from an input are noted: the client must send the computed ones. Lengths picked
    from an input are that input, as sent, unless the file shows otherwise (``claims``)."""
    if len(node.input) <= 4 or not node.input[4]:
        return
    value = index.constant(node.input[4])
    if value is not None:
        shown = np.asarray(value).ravel()[:8].tolist()
        raise ConversionError(
            f"node '{name}' has a constant sequence_lens ('{node.input[4]}' = {shown}); rnnserve takes the lengths "
            f"per request (the 'lengths' input), not from the file. Make it a graph input and send those lengths "
            f"per request (removing it would run every sequence at full length)"
        )
    if not _note_computed(index, node.input[4], f"node '{name}': sequence_lens", "lengths", notes) \
            and claims is not None and (feed := index.depends_on_input(node.input[4])):
        claims.append(StateClaim(node, 4, node.input[4], feed, ""))  # sent as 'lengths': no note unless it fails


# Ops that move, pick or join values without changing them: a state or lengths input reaching a node through
# only these is the input itself, as served (a layer's slice of a stacked h0 [L*D, B, H] input).
_SELECTING = SHAPE_OPS + ("Slice", "Gather", "Split", "Concat", "Expand", "Tile")


def _note_computed(index: GraphIndex, src: str, what: str, served: str, notes: list[str]) -> bool:
    """Note (and say True) when ``src`` is computed from a graph input by ops that change values (not only pick,
    reshape or join them): the served model takes the computed value as ``served``, so the client must compute
    it. Sending the graph input itself, as for a plain input, gave answers off by up to 3 (a probe's Neg before
    initial_h)."""
    changer = value_op(index, src, set())
    if changer is None:
        return False
    feeds = index.value_inputs(src)  # all of them: Where(cond, h, 0) named only 'cond'
    named = ", ".join(f"'{f}'" for f in feeds)
    notes.append(f"{what} is computed from graph input{'s' if len(feeds) > 1 else ''} {named} by "
                 f"{changer.op_type} (node '{index.name(changer)}'), which rnnserve does not serve: send the computed "
                 f"value per request as {served}, not {'any of them' if len(feeds) > 1 else named} itself")
    return True


def value_op(index: GraphIndex, name: str, seen: set[str]) -> NodeProto | None:
    """The first node on a path from a graph input to ``name`` that changes values (not only picks, reshapes or
    joins them), or None."""
    if name in seen or name not in index.producer:
        return None
    seen.add(name)
    node, _ = index.producer[name]
    if node.op_type == "Shape":
        return None
    fed = [i for i in node.input if i and index.depends_on_input(i)]
    if not fed:
        return None
    if node.op_type not in _SELECTING:
        return node
    return next((found for i in fed if (found := value_op(index, i, seen)) is not None), None)


def _check_state(index: GraphIndex, node: NodeProto, slot: int, label: str, name: str, notes: list[str],
                 claims: list[StateClaim] | None) -> None:
    if len(node.input) <= slot or not node.input[slot]:
        return
    src = node.input[slot]
    value = index.constant(src)
    if value is not None:
        if np.any(value != 0):
            raise ConversionError(
                f"node '{name}' has a constant nonzero {label} ('{src}'); rnnserve takes the initial state per "
                f"request (h_0/c_0), not from the file. Make it a graph input and send its value per request as "
                f"{'c_0' if label == 'initial_c' else 'h_0'} (removing it would start from zeros)"
            )
        return
    if _note_computed(index, src, f"node '{name}': {label}", 'c_0' if label == 'initial_c' else 'h_0', notes):
        return
    feed = index.depends_on_input(src)
    if feed:
        notes.append(f"node '{name}': {label} comes from graph input '{feed}'; send it per request as "
                     f"{'c_0' if label == 'initial_c' else 'h_0'} (zeros when omitted)")
        if claims is not None:  # picks can reorder or cut it: the whole-file check runs the file to see
            claims.append(StateClaim(node, slot, src, feed, notes[-1]))
        return
    zero = _zero_fill(index, src)
    if zero is not True:
        what = "nonzero" if zero is False else "computed (rnnserve cannot tell whether it is zero)"
        raise ConversionError(
            f"node '{name}' has a {what} {label} ('{src}') built inside the graph; rnnserve takes the initial "
            f"state per request (h_0/c_0), not from the file. Make it a graph input and send its value per request "
            f"as {'c_0' if label == 'initial_c' else 'h_0'}"
        )


def _zero_fill(index: GraphIndex, name: str) -> bool | None:
    """Whether a state built from constants and runtime shapes (Expand of a constant, ConstantOfShape) is all zeros."""
    value = index.constant(name)
    if value is not None:
        return not np.any(value)
    if name not in index.producer:
        return None
    node, _ = index.producer[name]
    if node.op_type == "ConstantOfShape":
        fill = index.attr(node, "value")
        return fill is None or not np.any(index.tensor_to_array(fill))
    if node.op_type in ("Expand", "Tile", "Reshape", "Identity", "Cast", "Unsqueeze", "Squeeze", "Transpose", "Slice",
                        "Gather", "Split"):
        return _zero_fill(index, node.input[0])
    if node.op_type == "Concat":
        parts = [_zero_fill(index, i) for i in node.input if i]
        return False if False in parts else (None if None in parts else True)
    return None


def node_to_layer(index: GraphIndex, node: NodeProto, notes: list[str],
                  claims: list[StateClaim] | None = None) -> RecurrentLayer:
    """Map one node's weights and attributes to a RecurrentLayer; refuse what rnnserve cannot express.
    ``claims`` collects the notes that call a state input the graph input itself (see :mod:`.onnx_state_check`)."""
    op, name = node.op_type, index.name(node)
    direction = _text(index.attr(node, "direction", "forward"))
    if direction not in _DIRECTIONS:
        raise ConversionError(f"node '{name}' has direction '{direction}'; expected one of {', '.join(_DIRECTIONS)}")
    d_count = 2 if direction == "bidirectional" else 1
    layout = int(index.attr(node, "layout", 0))
    if layout not in (0, 1):
        raise ConversionError(f"node '{name}' has layout={layout}; ONNX defines only 0 and 1")
    g = _GATES[op]
    w = _weight(index, node, 1, "W", name)
    r = _weight(index, node, 2, "R", name)
    if w is None or r is None:
        raise ConversionError(f"node '{name}' lacks its W or R input")
    h = index.attr(node, "hidden_size")
    if h is None:
        # onnxruntime refuses such a node, so a model served from it would answer what no runtime computes
        raise ConversionError(f"node '{name}' has no hidden_size attribute, which ONNX requires of {op}; "
                              f"export the model again")
    h = int(h)
    if h < 1:
        raise ConversionError(f"node '{name}' has hidden_size={h}; it must be positive")
    if w.ndim != 3 or w.shape[:2] != (d_count, g * h):
        raise ConversionError(f"node '{name}': W has shape {list(w.shape)}, expected [{d_count}, {g * h}, input_size]")
    if r.shape != (d_count, g * h, h):
        raise ConversionError(f"node '{name}': R has shape {list(r.shape)}, expected {[d_count, g * h, h]}")
    b = _weight(index, node, 3, "B", name)
    if b is None:
        b = np.zeros((d_count, 2 * g * h))
    elif b.shape != (d_count, 2 * g * h):
        raise ConversionError(f"node '{name}': B has shape {list(b.shape)}, expected {[d_count, 2 * g * h]}")
    _check_lengths(index, node, name, notes, claims)
    _check_state(index, node, 5, "initial_h", name, notes, claims)
    if op == "LSTM":
        _check_state(index, node, 6, "initial_c", name, notes, claims)
    p = _weight(index, node, 7, "P", name) if op == "LSTM" else None
    if p is not None and p.shape != (d_count, 3 * h):
        raise ConversionError(f"node '{name}': P has shape {list(p.shape)}, expected {[d_count, 3 * h]}")

    directions = []
    for d in range(d_count):
        bw, br = b[d, :g * h], b[d, g * h:]
        directions.append(LayerWeights(_reorder(w[d], op, h), _reorder(r[d], op, h),
                                       _reorder(bw, op, h), _reorder(br, op, h)))

    variant: dict = {}
    acts = _activations(index, node, op, d_count, name, notes)
    cell = {"LSTM": "lstm", "GRU": "gru"}.get(op)
    if op == "RNN":
        firsts = {a[0]["name"] for a in acts}
        cell = "rnn_relu" if firsts == {"relu"} else "rnn_tanh"
        if firsts - {"relu", "tanh"} or len(firsts) > 1:
            variant["activations"] = acts
    elif any([a["name"] for a in per] != [x.lower() for x in _DEFAULT_ACTS[op]] for per in acts):
        variant["activations"] = acts
    clip = index.attr(node, "clip")
    if clip is not None:
        if not float(clip) > 0:
            raise ConversionError(f"node '{name}' has clip={clip}; the clip threshold must be positive")
        variant["clip"] = float(clip)
    if op == "LSTM" and int(index.attr(node, "input_forget", 0)):
        variant["input_forget"] = True
    if op == "GRU" and not int(index.attr(node, "linear_before_reset", 0)):
        variant["reset_before"] = True
    if direction == "reverse":
        variant["reverse"] = True
    peephole = None
    if p is not None:
        variant["peephole"] = True
        peephole = [np.stack([p[d, :h], p[d, 2 * h:], p[d, h:2 * h]]) for d in range(d_count)]  # iof -> i, f, o
    return RecurrentLayer(name, cell, int(w.shape[2]), h, directions, 0, variant, peephole)
