"""Which recurrent nodes of an ONNX graph form one stack, and in what order.

Node k+1 of a stack must read node k's ``Y`` through shape-only ops (the
Transpose/Reshape/Squeeze that exporters put between layers), and those ops must
turn ``Y`` ([T, D, B, H], or [B, T, D, H] with layout=1) into exactly the
[T, B, D*H] (or [B, T, D*H]) the next node expects. That is checked by following
axis labels through the ops.
"""
from __future__ import annotations

from dataclasses import dataclass

from onnx import NodeProto

from ..errors import ConversionError
from .onnx_graph import RECURRENT_OPS, GraphIndex
from .onnx_shape_expr import Entry, target_entries

Label = tuple[str, ...]   # atoms "T", "B", "D", "H"; () is an axis of size 1


class _Unfollowable(Exception):
    """An op between two recurrent nodes whose effect on the axis labels cannot be followed (the message says why)."""


@dataclass
class Edge:
    """``dst`` reads ``src``'s Y; ``problem`` says why the rearrangement between them is not a plain stack."""

    src: NodeProto
    dst: NodeProto
    problem: str | None


def _dims(index: GraphIndex, node: NodeProto) -> tuple[int, int]:
    """(D, H) of a recurrent node, from its attributes and R."""
    d = 2 if _str(index.attr(node, "direction", b"forward")) == "bidirectional" else 1
    h = index.attr(node, "hidden_size")
    if h is None and len(node.input) > 2:
        r = index.constant(node.input[2])
        h = None if r is None else r.shape[-1]
    return d, int(h or 0)


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Axes:
    def __init__(self, d: int, h: int, static: dict[str, int] | None = None) -> None:
        self.sizes = {"D": d, "H": h}
        self.static = static or {}  # T and B as a static export fixed them: tells a kept unit axis from a new one

    def unit(self, label: Label) -> bool:
        """Whether the axis has size 1, counting a static export's T and B."""
        return all(self.sizes.get(a, self.static.get(a)) == 1 for a in label)

    def norm(self, label: Label) -> Label:
        return tuple(a for a in label if self.sizes.get(a, 0) != 1)

    def size(self, label: Label) -> int | None:
        n = 1
        for a in label:
            if a not in self.sizes:
                return None
            n *= self.sizes[a]
        return n


def _axes_arg(index: GraphIndex, node: NodeProto, rank: int, added: bool = False) -> list[int] | None:
    """The op's axes, made non-negative for input rank ``rank`` (output rank for Unsqueeze: ``added``)."""
    axes = index.attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = index.constant(node.input[1])
        if value is None:
            raise _Unfollowable(f"{node.op_type} '{index.name(node)}' has computed axes")
        axes = value.reshape(-1).tolist()
    if axes is None:
        return None
    rank += len(axes) if added else 0
    return [int(a) + rank if int(a) < 0 else int(a) for a in axes]


def _reshape(ax: _Axes, labels: list[Label], shape: list[Entry], what: str) -> list[Label]:
    def consume(target: int, cur: int, step: int) -> tuple[Label, int]:
        acc: Label = ()
        prod = 1
        while 0 <= cur < len(labels):
            lab = labels[cur]
            s = ax.size(lab)
            if s is None:
                if acc:
                    raise _Unfollowable(f"{what} merges the time or batch axis with others")
                return lab, cur + step
            acc = acc + lab if step > 0 else lab + acc
            prod *= s
            cur += step
            if prod == target:
                return acc, cur
            if prod > target:
                break
        raise _Unfollowable(f"{what} splits an axis")

    def same_axis(e: Label, cur: int, step: int) -> tuple[Label, int]:
        """A computed entry naming the time or batch axis: it must be the next axis with more than one element."""
        while 0 <= cur < len(labels) and ax.unit(labels[cur]) and ax.norm(labels[cur]) != ax.norm(e):
            cur += step
        if not 0 <= cur < len(labels) or ax.norm(labels[cur]) != ax.norm(e):
            raise _Unfollowable(f"{what} moves the time or batch axis")
        return labels[cur], cur + step

    if shape.count(-1) > 1:
        raise _Unfollowable(f"{what} has more than one -1")
    split = shape.index(-1) if -1 in shape else len(shape)
    left, right = shape[:split], shape[split + 1:]
    out_left: list[Label] = []
    cur = 0
    for j, e in enumerate(left):
        if isinstance(e, tuple):
            lab, cur = same_axis(e, cur, 1)
            out_left.append(lab)
        elif e == 0:
            if cur != j:
                raise _Unfollowable(f"{what} copies an axis out of place")
            out_left.append(labels[j])
            cur += 1
        elif e == 1 and (cur >= len(labels) or not ax.unit(labels[cur])):
            out_left.append(())
        else:
            lab, cur = consume(e, cur, 1)
            out_left.append(lab)
    end = len(labels) - 1
    out_right: list[Label] = []
    for e in reversed(right):
        if isinstance(e, tuple):
            lab, end = same_axis(e, end, -1)
            out_right.insert(0, lab)
            continue
        if e == 0 or (e == 1 and not ax.unit(labels[end])):
            if e == 0:
                raise _Unfollowable(f"{what} copies an axis after -1")
            out_right.insert(0, ())
            continue
        lab, end = consume(e, end, -1)
        out_right.insert(0, lab)
    if split < len(shape):
        middle: Label = tuple(a for lab in labels[cur:end + 1] for a in lab)
        return out_left + [middle] + out_right
    if any(ax.size(lab) != 1 for lab in labels[cur:end + 1]):
        raise _Unfollowable(f"{what} does not keep every element")
    return out_left + out_right


def follow_labels(index: GraphIndex, src: NodeProto, ops: list[NodeProto]) -> list[Label]:
    """Axis labels of the value that ``ops`` make from ``src``'s Y."""
    d, h = _dims(index, src)
    layout = index.attr(src, "layout", 0)
    ax = _Axes(d, h, _static_time_batch(index, src, layout))
    labels: list[Label] = [("B",), ("T",), ("D",), ("H",)] if layout == 1 else [("T",), ("D",), ("B",), ("H",)]
    value = src.output[0]
    for node in ops:
        what = f"{node.op_type} '{index.name(node)}'"
        op = node.op_type
        if op in ("Identity", "Dropout", "Cast"):
            value = node.output[0]  # a later Reshape may measure this name's shape
            continue
        if op == "Transpose":
            perm = index.attr(node, "perm") or list(range(len(labels)))[::-1]
            labels = [labels[p] for p in perm]
        elif op == "Squeeze":
            axes = _axes_arg(index, node, len(labels))
            if axes is None:
                axes = [j for j, lab in enumerate(labels) if ax.size(lab) == 1]
            if any(ax.size(labels[a]) != 1 for a in axes):
                raise _Unfollowable(f"{what} squeezes an axis that may not have size 1")
            labels = [lab for j, lab in enumerate(labels) if j not in axes]
        elif op == "Unsqueeze":
            axes = _axes_arg(index, node, len(labels), added=True)
            if axes is None:
                raise _Unfollowable(f"{what} has no axes")
            for a in sorted(axes):
                labels.insert(a, ())
        elif op == "Flatten":
            axis = int(index.attr(node, "axis", 1))
            axis = axis + len(labels) if axis < 0 else axis
            labels = [tuple(a for lab in labels[:axis] for a in lab), tuple(a for lab in labels[axis:] for a in lab)]
        elif op == "Reshape":
            shape = target_entries(index, node.input[1], value, labels) if len(node.input) > 1 else None
            if shape is None:
                raise _Unfollowable(f"{what} has a target shape computed from more than the shape of its input")
            shape = [e if isinstance(e, int) or ax.size(e) is None else ax.size(e) for e in shape]
            if index.attr(node, "allowzero", 0) and 0 in shape:
                raise _Unfollowable(f"{what} reshapes to an empty tensor")
            labels = _reshape(ax, labels, shape, what)
        else:
            raise _Unfollowable(f"{what} is not a shape-only op")
        value = node.output[0]
    return [ax.norm(lab) for lab in labels]


def _static_time_batch(index: GraphIndex, src: NodeProto, layout: int) -> dict[str, int]:
    """T and B of ``src``'s Y where the file fixes them (an export without dynamic axes)."""
    dims = index.dims(src.output[0])
    if not dims or len(dims) != 4:
        return {}
    t, b = (dims[1], dims[0]) if layout == 1 else (dims[0], dims[2])
    return {k: v for k, v in (("T", t), ("B", b)) if v}


def find_edges(index: GraphIndex, nodes: list[NodeProto]) -> list[Edge]:
    """Every (src, dst) pair where dst's X comes from src's Y through shape-only ops."""
    edges = []
    for dst in nodes:
        traced = index.trace_input(dst.input[0]) if dst.input else None
        if traced is None or not any(traced.source is n for n in nodes):
            continue
        src = traced.source
        d, h = _dims(index, src)
        ax = _Axes(d, h)
        want = [("B",), ("T",), ax.norm(("D", "H"))] if index.attr(dst, "layout", 0) == 1 else \
            [("T",), ("B",), ax.norm(("D", "H"))]
        try:
            got = follow_labels(index, src, traced.ops)
            problem = None if got == want else (
                f"the ops between them turn Y into axes {_show(got)} where '{index.name(dst)}' expects {_show(want)}")
        except _Unfollowable as exc:
            problem = str(exc)
        edges.append(Edge(src, dst, problem))
    return edges


def _show(labels: list[Label]) -> str:
    return "[" + ", ".join("*".join(lab) or "1" for lab in labels) + "]"


def order_chain(index: GraphIndex, nodes: list[NodeProto], edges: list[Edge]) -> list[NodeProto]:
    """Order ``nodes`` as one stack (each reads the previous one's Y); refuse anything else by name."""
    ids = {id(n) for n in nodes}
    inner = [e for e in edges if id(e.src) in ids and id(e.dst) in ids]
    for e in inner:
        if e.problem:
            raise ConversionError(
                f"node '{index.name(e.dst)}' reads the output of '{index.name(e.src)}', "
                f"but not as a plain layer stack: "
                f"{e.problem}. rnnserve serves only a stack whose ops between nodes keep Y's values in place: "
                f"convert one node (--select {index.name(e.src)}) and do the rest on the client, or export the "
                f"model with the layers stacked as nn.LSTM/GRU/RNN's own num_layers"
            )
    nxt = {id(e.src): e.dst for e in inner}
    has_prev = {id(e.dst) for e in inner}
    heads = [n for n in nodes if id(n) not in has_prev]
    chains = []
    for head in heads:
        chain = [head]
        while id(chain[-1]) in nxt and len(chain) <= len(nodes):
            chain.append(nxt[id(chain[-1])])
        chains.append(chain)
    branching = len({id(e.src) for e in inner}) != len(inner)
    if len(chains) == 1 and not branching and len(chains[0]) == len(nodes):
        return chains[0]
    listing = "; ".join(" -> ".join(index.name(n) for n in c) for c in chains)
    reason = "one recurrent output feeds several recurrent nodes" if branching else \
        f"they form {len(chains)} separate chains ({listing})"
    if not branching:
        # what keeps a chain apart: the op its first node reads from (a Relu, an Add, a Slice of one direction)
        reads = [f"'{index.name(c[0])}' reads its input from {op}" for c in chains
                 if c[0].input and (op := index.first_other_op(c[0].input[0])) is not None]
        if reads:
            reason += f"; {', '.join(reads)}, which is no layer rnnserve serves"
    raise ConversionError(
        f"the recurrent nodes {', '.join(index.name(n) for n in nodes)} are not one stack: {reason}. "
        f"Pick one chain with --select name1,name2,... (in data-flow order or any order)"
    )


def recurrent_nodes(index: GraphIndex) -> list[NodeProto]:
    return [n for n in index.nodes if n.op_type in RECURRENT_OPS and n.domain in ("", "ai.onnx")]
