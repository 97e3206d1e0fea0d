"""A Reshape's target shape that the graph computes from the reshaped tensor's own shape, as axis labels.

torch.onnx.export's dynamo exporter (torch's default, as in torch 2.13) writes the step between two stacked
recurrent nodes with dynamic axes as ``Reshape(y, Concat(Slice(Shape(y)), Slice(Shape(y)),
Mul(Slice(Shape(y)), Slice(Shape(y)))))``: [T, B, D, H] to [T, B, D*H] with T and B known only at run
time. Such a target is evaluated here symbolically: each entry becomes the label of the axes it
measures (or a number where it is a constant), so that :mod:`.onnx_chain` can check the Reshape keeps
the stack's layout as it does for constant targets.
"""
from __future__ import annotations

import numpy as np
from onnx import NodeProto

from .onnx_graph import GraphIndex

Label = tuple[str, ...]
Entry = int | Label   # a constant, or the size of the axes a label names

# deeper expressions than this are not an exporter's shape arithmetic
_MAX_DEPTH = 32


def target_entries(index: GraphIndex, name: str, data: str, labels: list[Label]) -> list[Entry] | None:
    """The entries of the 1-D int64 tensor ``name``, built only from constants and ``Shape(data)``, where
    ``data`` has axis ``labels``; None when it is built from anything else."""
    return _entries(index, name, data, labels, 0)


def _entries(index: GraphIndex, name: str, data: str, labels: list[Label], depth: int) -> list[Entry] | None:
    if depth > _MAX_DEPTH or not name:
        return None
    value = index.constant(name)
    if value is not None:
        return [int(v) for v in value.reshape(-1)]
    if name not in index.producer:
        return None
    node, k = index.producer[name]
    if k != 0 or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type

    def sub(j: int) -> list[Entry] | None:
        return _entries(index, node.input[j], data, labels, depth + 1) if len(node.input) > j else None

    if op == "Shape":
        if node.input[0] != data:
            return None
        start, end = index.attr(node, "start", 0), index.attr(node, "end", None)
        return list(labels)[start:end]
    if op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Flatten"):
        return sub(0)  # a 1-D or scalar shape value keeps its entries in order
    if op == "Concat":
        parts = [_entries(index, i, data, labels, depth + 1) for i in node.input]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if op == "Slice":
        return _slice(index, node, sub(0))
    if op == "Gather":
        values, at = sub(0), index.constant(node.input[1]) if len(node.input) > 1 else None
        if values is None or at is None or int(index.attr(node, "axis", 0)) != 0:
            return None
        try:
            return [values[int(i)] for i in at.reshape(-1)]
        except IndexError:
            return None
    if op == "Mul":
        a, b = sub(0), sub(1)
        if a is None or b is None or len(a) != 1 or len(b) != 1:
            return None
        return [_product(a[0], b[0])] if _product(a[0], b[0]) is not None else None
    return None


def _slice(index: GraphIndex, node: NodeProto, values: list[Entry] | None) -> list[Entry] | None:
    if values is None:
        return None
    if index.opset() < 10:  # starts, ends and axes were attributes then
        starts, ends, axes, steps = (_ints(index.attr(node, a)) for a in ("starts", "ends", "axes", "steps"))
    else:
        starts, ends, axes, steps = (_ints(index.constant(i)) if i else None for i in
                                     (list(node.input[1:5]) + [""] * 4)[:4])
    if not starts or not ends or (axes is not None and axes not in ([0], [-1])):
        return None
    step = steps[0] if steps else 1
    # ONNX clamps negative and out-of-range starts and ends as Python's slices do
    return values[starts[0]:ends[0]:step] if step else None


def _ints(value) -> list[int] | None:
    return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def _product(a: Entry, b: Entry) -> Entry | None:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if isinstance(a, int):
        a, b = b, a
    if isinstance(b, int):
        return a if b == 1 else None
    return a + b
