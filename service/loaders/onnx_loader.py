"""ONNX loader: LSTM, GRU and RNN nodes -> RecurrentLayers, and an onnxruntime runner to verify them.

One ONNX node is one layer (layouts.md section 4). Exporters put a node per layer
with Transpose/Reshape/Squeeze between them; :mod:`.onnx_chain` follows that data
flow and :func:`service.loaders.layers.assemble` merges the layers into blocks.
Everything around the recurrent stack (embeddings, heads, state plumbing) is not
converted; rnnserve serves the stack.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from ..errors import ConversionError
from .onnx_chain import find_edges, order_chain, recurrent_nodes
from .onnx_file_check import session_options, whole_file_check
from .onnx_graph import GraphIndex, keeps_values, read_model
from .onnx_nodes import node_to_layer
from .onnx_state_check import StateClaim
from .source import LoadedSource, SourceRunner, option_flags, unserved_note
from .verify import ATOL, RTOL

_RUNNER_OPSET = 17


def load_onnx(path: Path, select: str | None = None, cell: str | None = None, **options: Any) -> LoadedSource:
    """Read the recurrent stack of an ONNX model.

    ``select`` names nodes (comma-separated; unnamed nodes are ``<op>_<k>``, k counting
    that op type in graph order, subgraphs included). Without it, every recurrent node
    of the graph must belong to one stack. ``cell``, when given, must match the nodes.
    ``options`` (the Keras loader's recurrent_activation) are refused: an ONNX node names its activations.
    """
    if options:
        raise ConversionError(f"an ONNX file takes no {option_flags(options)}: an ONNX node names its own "
                              f"activations (it takes --select and --cell)")
    path = Path(path)
    index = GraphIndex(read_model(path), path.parent)
    candidates = recurrent_nodes(index)
    if not candidates:
        ops = sorted({n.op_type for n in index.nodes})
        unrolled = "MatMul" in ops and ({"Tanh", "Relu", "Sigmoid"} & set(ops))
        hint = ("; its recurrence looks unrolled into per-step ops, as torch.onnx.export's dynamo exporter (the "
                "default in current torch, 2.13 here) writes nn.RNN: export with dynamo=False, or convert the "
                "PyTorch module's state dict instead") if unrolled else ""
        raise ConversionError(f"'{path.name}' has no LSTM, GRU or RNN node (its ops: {', '.join(ops[:12])}){hint}")
    chosen = _select(index, candidates, select) if select else candidates
    chain = order_chain(index, chosen, find_edges(index, chosen))
    notes: list[str] = []
    _check_repeated(index, chain, bool(select), notes)
    claims: list[StateClaim] = []
    layers = [node_to_layer(index, node, notes, claims) for node in chain]
    if cell:
        for layer in layers:
            if layer.cell != cell:
                raise ConversionError(f"--cell {cell} does not match node '{layer.name}', an ONNX "
                                      f"{_node(chain, layer.name, index).op_type} ({layer.cell})")
    # ops that see only shapes (an exporter's arithmetic on Shape) compute nothing a client would have to apply
    flowing = index.input_values()
    before_stack = index.input_values(through_recurrent=False)
    upstream = before_stack & index.feeding(chain[0].input[0])
    data = upstream | (flowing - before_stack)  # what the stack reads as X, and what comes of its outputs
    computing = [n for n in index.nodes if n.op_type not in ("LSTM", "GRU", "RNN")
                 and any(o in flowing for o in n.output) and _computes_on_values(n, upstream, data)]
    others = sorted({n.op_type for n in computing})
    # truncating Casts alone leave the file's outputs those of the stack, cast: compared whole, and refused there
    stack_is_graph = all(n.op_type == "Cast" for n in computing) and len(candidates) == len(chain)
    if others or len(candidates) != len(chain):
        notes.append(unserved_note("the recurrent stack " + " -> ".join(index.name(n) for n in chain), "graph",
                                   ", ".join(others) or "other recurrent nodes"))
    producer = model_producer(index)
    return LoadedSource(
        format="onnx",
        layers=layers,
        selection=[index.name(n) for n in chain],
        notes=notes,
        runner=(runner := _make_runner(index, chain)),
        ragged_ok=True,
        file_check=None if runner is None else whole_file_check(
            path, index, chain, stack_is_graph, layers[0].input_size, len(layers[-1].directions), RTOL, ATOL,
            claims, notes),
        details={"onnx_opset": index.opset(), **({"onnx_producer": producer} if producer else {})},
    )


def _check_repeated(index: GraphIndex, chain: list[NodeProto], selected: bool, notes: list[str]) -> None:
    """A recurrent node inside a Loop or Scan body: the file applies it once per iteration (the same weights M
    times), the served stack once. It was served with only a note that the graph also has a Loop, and its answers
    were unlike the file's; now refused, unless picked with --select (a decoder's one-step LSTM that the client
    drives itself), and then noted."""
    for node in chain:
        owner = index.enclosing.get(id(node))
        while owner is not None and owner.op_type not in ("Loop", "Scan"):
            owner = index.enclosing.get(id(owner))
        if owner is None:
            continue
        where = (f"node '{index.name(node)}' is inside the body of {owner.op_type} '{index.name(owner)}', which "
                 f"applies it once per iteration")
        if not selected:
            raise ConversionError(
                f"{where}; rnnserve serves a recurrent stack applied once. To serve one application (a decoder "
                f"step the client repeats, as requests or stream chunks), pick it with --select "
                f"{index.name(node)}; else export the repeated layers as a stack of nodes")
        notes.append(f"{where}: the served model is one application; repeat it yourself (one request, or stream "
                     f"chunk, per iteration)")


def _computes_on_values(node: NodeProto, upstream: set[str], data: set[str]) -> bool:
    """Whether ``node`` changes what it is given, as opposed to moving values (shape ops) or computing shapes.
    Gather, Slice, Expand and Concat do either: on a graph input's values on their way to the stack's X
    (``upstream``) they change what the stack reads (reversing time, dropping steps); elsewhere they compute shapes,
    split initial states per layer (what h_0/c_0 give), or join the stack's final states into h_n, which rnnserve
    serves."""
    if keeps_values(node) or node.op_type in ("Constant", "Shape", "ConstantOfShape"):
        return False
    if node.op_type == "Cast":  # to an integer or bool type: it truncates the data, not lengths (float lengths)
        return any(o in data for o in node.output)
    if node.op_type in ("Gather", "Slice", "Expand"):
        return bool(node.input) and node.input[0] in upstream
    if node.op_type == "Concat":
        return any(i in upstream for i in node.input)
    return True


def model_producer(index: GraphIndex) -> str:
    m = index.model
    return f"{m.producer_name} {m.producer_version}".strip()


def _node(chain: list[NodeProto], name: str, index: GraphIndex) -> NodeProto:
    return next(n for n in chain if index.name(n) == name)


def _select(index: GraphIndex, candidates: list[NodeProto], select: str) -> list[NodeProto]:
    named = [s.strip() for s in select.split(",") if s.strip()]
    twice = sorted({s for s in named if named.count(s) > 1})
    if twice:  # as the other loaders: a node stacked on itself is a typo, and a stored model holds each layer once
        raise ConversionError(f"--select names {', '.join(repr(s) for s in twice)} more than once; name each "
                              f"recurrent node once, in the order the model stacks them")
    wanted = named
    available = ", ".join(f"{index.name(n)} ({n.op_type})" for n in candidates)
    hint = " (unnamed nodes are called <op>_<k>, k counting that op type in graph order)" if index.unnamed else ""
    if not wanted:
        raise ConversionError(f"--select '{select}' names no node; recurrent nodes: {available}{hint}")
    by_name = {index.name(n): n for n in index.nodes}
    chosen = []
    for name in wanted:
        node = by_name.get(name)
        if node is None:
            raise ConversionError(f"--select: the model has no node named '{name}'; recurrent nodes: {available}{hint}")
        if not any(node is c for c in candidates):
            raise ConversionError(f"--select: node '{name}' is a {node.op_type}, not an LSTM, GRU or RNN node; "
                                  f"recurrent nodes: {available}{hint}")
        chosen.append(node)
    return chosen


# ---- runner -------------------------------------------------------------------------------------------------------

def chain_model(index: GraphIndex, chain: list[NodeProto]):
    """An ONNX model of just ``chain``: X [T, B, I] (layout 0), sequence_lens [B] -> Y [B, T, D*H].

    The nodes keep their own attributes (activations, clip, ...) and the file's weights
    in ONNX order, so running it checks the gate mapping independently.
    """
    nodes, inits = [], []
    x = "X"
    for k, node in enumerate(chain):
        inputs = [x]
        for slot, label in ((1, "W"), (2, "R"), (3, "B")):
            value = index.constant(node.input[slot]) if len(node.input) > slot and node.input[slot] else None
            if value is None and label == "B":
                value = np.zeros((index.constant(node.input[1]).shape[0], 2 * index.constant(node.input[2]).shape[1]))
            inits.append(numpy_helper.from_array(np.asarray(value, np.float32), f"{label}{k}"))
            inputs.append(f"{label}{k}")
        inputs += ["sequence_lens", "", ""]
        if node.op_type == "LSTM" and len(node.input) > 7 and node.input[7]:
            inits.append(numpy_helper.from_array(np.asarray(index.constant(node.input[7]), np.float32), f"P{k}"))
            inputs.append(f"P{k}")
        inputs = inputs[:6] if node.op_type != "LSTM" else inputs
        while inputs and inputs[-1] == "":
            inputs.pop()
        copy = helper.make_node(node.op_type, inputs, [f"Y{k}"], name=f"{node.op_type}{k}")
        copy.attribute.extend(a for a in node.attribute if a.name != "layout")
        nodes.append(copy)
        d = 2 if index.attr(node, "direction", b"forward") in (b"bidirectional", "bidirectional") else 1
        if d == 2:
            nodes.append(helper.make_node("Transpose", [f"Y{k}"], [f"Yt{k}"], perm=[0, 2, 1, 3]))
            nodes.append(helper.make_node("Reshape", [f"Yt{k}", "flat"], [f"S{k}"]))
        else:
            nodes.append(helper.make_node("Squeeze", [f"Y{k}", "axis1"], [f"S{k}"]))
        x = f"S{k}"
    nodes.append(helper.make_node("Transpose", [x], ["Y"], perm=[1, 0, 2]))
    used = {i for n in nodes for i in n.input}
    inits += [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("flat", [0, 0, -1]), ("axis1", [1])) if n in used]
    graph = helper.make_graph(
        nodes, "rnnserve_chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "B", None]),
         helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "T", None])],
        inits,
    )
    # IR 8 (onnx 1.13) keeps the model readable by any onnxruntime this project supports.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _RUNNER_OPSET)], ir_version=8)


def _make_runner(index: GraphIndex, chain: list[NodeProto]) -> SourceRunner | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    model_bytes = chain_model(index, chain).SerializeToString()
    session = []

    def run(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if not session:
            session.append(ort.InferenceSession(model_bytes, session_options(ort, 3), providers=["CPUExecutionProvider"]))
        xt = np.ascontiguousarray(np.asarray(x, np.float32).transpose(1, 0, 2))
        lens = np.asarray(lengths, np.int32)
        y = session[0].run(["Y"], {"X": xt, "sequence_lens": lens})[0]
        y[np.arange(y.shape[1])[None, :] >= lens[:, None]] = 0.0  # the engine contract; ORT already zeroes these
        return y

    return run
