"""Reading an ONNX file safely and answering questions about its data flow.

:func:`read_model` parses the protobuf without touching external data;
:class:`GraphIndex` flattens the main graph and every subgraph (``If``, ``Loop``,
``Scan`` bodies) into one name space, names the unnamed nodes, resolves constant
tensors (reading external data only from inside the model's own folder) and
traces a recurrent node's input back through shape-only ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, NodeProto, TensorProto, helper, numpy_helper

from ..errors import ConversionError
from .source import what_file_is

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
# Ops that move or relabel data without changing values (a Cast only to a float type: see keeps_values).
SHAPE_OPS = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Dropout", "Cast")
# Cast targets that keep a float value a float: 16-bit ones round, which the whole-file check compares within
# float16's tolerance (converters keep an fp16 file's recurrent nodes in float32 between such casts)
_FLOAT_CASTS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def keeps_values(node: NodeProto) -> bool:
    """Whether ``node`` only moves or relabels data: a shape op, a Cast only to a float type. A Cast to an integer
    or bool type truncates: X -> Cast(INT32) -> Cast(FLOAT) -> LSTM -> head converted as if the casts were not
    there, and the served answers were 0.4 off."""
    if node.op_type not in SHAPE_OPS:
        return False
    return node.op_type != "Cast" or _cast_target(node) in _FLOAT_CASTS


def _cast_target(node: NodeProto) -> int | None:
    for a in node.attribute:
        if a.name == "to":
            return a.i
    return None
# Ops whose output is a constant when every input is one; folded with onnx's reference evaluator.
FOLDABLE_OPS = SHAPE_OPS + (
    "Concat", "Slice", "Split", "Gather", "Constant", "ConstantOfShape", "Expand", "Tile", "Mul", "Add", "Sub",
    "Div", "Neg", "Shape", "Range", "ReduceSum", "CastLike",
)


def read_model(path: Path) -> onnx.ModelProto:
    """Parse ``path`` without loading external data; refuse unreadable files with a clear message."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends
        other = what_file_is(path)
        if other is not None and other[0] != "onnx":
            raise ConversionError(
                f"'{path.name}' is not an ONNX model but {other[1]}; convert it with --format {other[0]}"
            ) from exc
        raise ConversionError(
            f"'{path.name}' is not a readable ONNX model: the file is truncated or corrupt "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if not model.HasField("graph") or not model.graph.node:
        raise ConversionError(f"'{path.name}' holds no ONNX graph (is the file truncated or not an ONNX model?)")
    return model


def _subgraphs(node: NodeProto) -> list[onnx.GraphProto]:
    out = []
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


@dataclass
class Traced:
    """Where a recurrent node's X comes from: another recurrent node's Y, through ``ops``."""

    source: NodeProto
    ops: list[NodeProto]


class GraphIndex:
    """The model's nodes, values and constants, with every subgraph flattened in."""

    def __init__(self, model: onnx.ModelProto, model_dir: Path) -> None:
        self.model = model
        self.model_dir = model_dir.resolve()
        self.nodes: list[NodeProto] = []
        self.names: dict[int, str] = {}          # id(node) -> display name
        self.producer: dict[str, tuple[NodeProto, int]] = {}
        self.initializers: dict[str, TensorProto] = {}
        self.graph_inputs: set[str] = set()      # inputs without an initializer, incl. subgraph inputs
        self.consumers: dict[str, list[NodeProto]] = {}
        self._const_cache: dict[str, np.ndarray | None] = {}
        self.static_dims: dict[str, list[int | None]] = {}  # value -> its dims where the file states them
        self._input_values: set[str] | None = None
        self._inferred = False
        self.enclosing: dict[int, NodeProto] = {}  # id(node) -> the node (If, Loop, Scan) whose subgraph holds it
        self._walk(model.graph)
        self.graph_inputs -= set(self.initializers)
        self._name_nodes()

    def _walk(self, graph: onnx.GraphProto, owner: NodeProto | None = None) -> None:
        for init in graph.initializer:
            self.initializers.setdefault(init.name, init)
        for sparse in graph.sparse_initializer:
            self.initializers.setdefault(sparse.values.name, numpy_helper.from_array(
                numpy_helper.to_array(sparse), sparse.values.name))
        self.graph_inputs.update(i.name for i in graph.input)
        self._read_dims(graph)
        for node in graph.node:
            self.nodes.append(node)
            if owner is not None:
                self.enclosing[id(node)] = owner
            for k, out in enumerate(node.output):
                if out:
                    self.producer.setdefault(out, (node, k))
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)
            for sub in _subgraphs(node):
                self._walk(sub, node)

    def _name_nodes(self) -> None:
        """Unnamed nodes are called ``<op>_<k>``, k counting nodes of that op type in graph order."""
        counts: dict[str, int] = {}
        taken = {n.name for n in self.nodes if n.name}
        seen: set[str] = set()
        for node in self.nodes:
            k = counts.get(node.op_type, 0)
            counts[node.op_type] = k + 1
            name = node.name or f"{node.op_type}_{k}"
            if not node.name:
                while name in taken:
                    name += "_"
            if name in seen:  # duplicate names in the file: keep them apart
                name = f"{name}#{k}"
            seen.add(name)
            self.names[id(node)] = name
        self.unnamed = any(not n.name for n in self.nodes)

    def name(self, node: NodeProto) -> str:
        return self.names[id(node)]

    def opset(self) -> int:
        for imp in self.model.opset_import:
            if imp.domain in ("", "ai.onnx"):
                return int(imp.version)
        return 0

    # ---- constants -------------------------------------------------------------------------------------------

    def tensor_to_array(self, tensor: TensorProto) -> np.ndarray:
        """Decode a tensor, reading external data only from files inside the model's folder."""
        if tensor.data_location == TensorProto.EXTERNAL:
            tensor = self._load_external(tensor)
        try:
            return numpy_helper.to_array(tensor)
        except Exception as exc:
            raise ConversionError(f"tensor '{tensor.name}' cannot be decoded ({exc}); is the file corrupt?") from exc

    def _load_external(self, tensor: TensorProto) -> TensorProto:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise ConversionError(f"tensor '{tensor.name}' is stored externally but names no file")
        target = Path(location)
        resolved = (self.model_dir / target).resolve()
        if target.is_absolute() or not resolved.is_relative_to(self.model_dir):
            raise ConversionError(
                f"tensor '{tensor.name}' points to external data '{location}', which is outside the model's folder "
                f"'{self.model_dir}'; external data files must sit in the model's folder or below it"
            )
        if not resolved.is_file():
            raise ConversionError(
                f"external data file '{location}' of tensor '{tensor.name}' does not exist next to the model")
        offset = int(info.get("offset", 0) or 0)
        count = np.prod(tensor.dims, dtype=np.int64) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        length = int(info.get("length", 0) or count)
        size = resolved.stat().st_size
        if offset + length > size or length != count:
            raise ConversionError(
                f"external data of tensor '{tensor.name}' in '{location}' is truncated or inconsistent: needs bytes "
                f"{offset}..{offset + count} (shape {list(tensor.dims)}), the file has {size} bytes"
            )
        with open(resolved, "rb") as fh:
            fh.seek(offset)
            raw = fh.read(length)
        copy = TensorProto()
        copy.CopyFrom(tensor)
        del copy.external_data[:]
        copy.data_location = TensorProto.DEFAULT
        copy.raw_data = raw
        return copy

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is a constant (initializer, Constant node, or folded from them), else None."""
        if name in self._const_cache:
            return self._const_cache[name]
        self._const_cache[name] = None  # breaks cycles
        value = self._constant(name)
        self._const_cache[name] = value
        return value

    def _constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return self.tensor_to_array(self.initializers[name])
        if name in self.graph_inputs or name not in self.producer:
            return None
        node, k = self.producer[name]
        if node.domain not in ("", "ai.onnx") or node.op_type not in FOLDABLE_OPS:
            return None
        if node.op_type == "Constant":
            attr = node.attribute[0]
            if attr.type == AttributeProto.TENSOR:
                return self.tensor_to_array(attr.t)
            return np.asarray(helper.get_attribute_value(attr))
        if node.op_type == "Shape":
            return None  # depends on a runtime shape in the cases that matter
        inputs = [self.constant(i) if i else None for i in node.input]
        if any(v is None for v, i in zip(inputs, node.input) if i):
            return None
        return self._fold(node, k, inputs)

    def _fold(self, node: NodeProto, k: int, inputs: list[np.ndarray | None]) -> np.ndarray | None:
        from onnx.reference import ReferenceEvaluator

        names = [f"in{j}" if i else "" for j, i in enumerate(node.input)]
        outs = [f"out{j}" for j in range(len(node.output))]
        folded = helper.make_node(node.op_type, names, outs, domain=node.domain)
        folded.attribute.extend(node.attribute)
        graph = helper.make_graph(
            [folded], "fold", [],
            [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs],
            [numpy_helper.from_array(np.asarray(v), n) for v, n in zip(inputs, names) if n],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(self.opset(), 13))])
        try:
            return np.asarray(ReferenceEvaluator(model).run(None, {})[k])
        except Exception:
            return None

    def dims(self, name: str) -> list[int | None] | None:
        """``name``'s dims as the file states them or, when it does not, as onnx's shape inference finds them
        (run once, on demand: files from other exporters than torch's often carry no value shapes)."""
        if name not in self.static_dims and not self._inferred:
            self._inferred = True
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model, strict_mode=False)
            except Exception:  # noqa: BLE001 - inference is a help here; a graph it cannot type stays unknown
                return None
            self._read_dims(inferred.graph)
        return self.static_dims.get(name)

    def _read_dims(self, graph: onnx.GraphProto) -> None:
        for info in (*graph.input, *graph.value_info, *graph.output):
            if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
                self.static_dims.setdefault(info.name, [d.dim_value if d.HasField("dim_value") else None
                                                        for d in info.type.tensor_type.shape.dim])

    def input_values(self, through_recurrent: bool = True) -> set[str]:
        """Every value that graph inputs' *values* flow into (Shape cuts the flow, and so do the recurrent nodes
        unless ``through_recurrent``), in one pass over the nodes in graph order (ONNX stores them topologically
        sorted)."""
        if through_recurrent and self._input_values is not None:
            return self._input_values
        stops = ("Shape",) if through_recurrent else ("Shape", *RECURRENT_OPS)
        flowing = set(self.graph_inputs)
        for node in self.nodes:
            if node.op_type not in stops and any(i in flowing for i in node.input):
                flowing.update(o for o in node.output if o)
        if through_recurrent:
            self._input_values = flowing
        return flowing

    def feeding(self, name: str) -> set[str]:
        """``name`` and every value it is computed from."""
        seen, todo = set(), [name]
        while todo:
            value = todo.pop()
            if value in seen or not value:
                continue
            seen.add(value)
            if value in self.producer:
                todo.extend(self.producer[value][0].input)
        return seen

    def past_shape_ops(self, name: str, any_cast: bool = False) -> tuple[str, NodeProto | None, int]:
        """Where ``name`` comes from past shape-only ops: (that value, the node producing it or None for a graph
        input or initializer, which of the node's outputs it is). ``any_cast``: past truncating Casts too (the
        whole-file check, whose comparison then shows what they change)."""
        while name in self.producer:
            node, k = self.producer[name]
            passes = node.op_type in SHAPE_OPS if any_cast else keeps_values(node)
            if not passes or not node.input:
                return name, node, k
            name = node.input[0]
        return name, None, 0

    def depends_on_input(self, name: str, _seen: set[str] | None = None) -> str | None:
        """The first graph input whose *values* flow into ``name`` (Shape cuts the flow), or None."""
        seen = _seen if _seen is not None else set()
        if not name or name in seen or name in self.initializers:
            return None
        seen.add(name)
        if name in self.graph_inputs:
            return name
        if name not in self.producer:
            return None
        node, _ = self.producer[name]
        if node.op_type == "Shape":
            return None
        for inp in node.input:
            found = self.depends_on_input(inp, seen)
            if found:
                return found
        return None

    def value_inputs(self, name: str) -> list[str]:
        """Every graph input whose *values* flow into ``name`` (Shape cuts the flow), main graph inputs first in
        their order: :meth:`depends_on_input` names only the first one found."""
        found, seen, todo = set(), set(), [name]
        while todo:
            value = todo.pop()
            if not value or value in seen or value in self.initializers:
                continue
            seen.add(value)
            if value in self.graph_inputs:
                found.add(value)
            elif value in self.producer and self.producer[value][0].op_type != "Shape":
                todo.extend(self.producer[value][0].input)
        order = [i.name for i in self.model.graph.input]
        return sorted(found, key=lambda f: (order.index(f) if f in order else len(order), f))

    # ---- data flow -------------------------------------------------------------------------------------------

    def trace_input(self, name: str) -> Traced | None:
        """Follow ``name`` back through shape-only ops to a recurrent node's Y; None when it comes from elsewhere."""
        ops: list[NodeProto] = []
        while name in self.producer:
            node, k = self.producer[name]
            if node.op_type in RECURRENT_OPS and node.domain in ("", "ai.onnx"):
                return Traced(node, ops[::-1]) if k == 0 else None
            if not keeps_values(node) or not node.input:
                return None
            ops.append(node)
            name = node.input[0]
        return None

    def first_other_op(self, name: str) -> str | None:
        """The op that ``name`` comes from past shape-only ops, as "Relu 'relu_1'", or None when it is a graph
        input, an initializer or a recurrent node's Y (what :meth:`trace_input` follows)."""
        _, node, k = self.past_shape_ops(name)
        if node is None:
            return None
        if node.op_type in RECURRENT_OPS and node.domain in ("", "ai.onnx"):
            return None if k == 0 else f"output {k} of {node.op_type} '{self.name(node)}'"
        return f"{node.op_type} '{self.name(node)}'"

    def attr(self, node: NodeProto, name: str, default: Any = None) -> Any:
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default
