"""stack_problem: whether a TorchScript archive feeds each selected recurrent module straight from the one before.

``--select r1,r2`` serves r1's output as r2's input. Where the archive holds only its recurrent
modules, running it whole (:mod:`.torchscript_check`) shows whether its code does the same; where
it also holds a head or an embedding, its outputs are more than the served stack's and cannot be
compared, and code between the modules (``r2(3 * y)``, a Linear, a flip) went unseen: such a
conversion said "verified" and served numbers 0.05-0.2 away from the archive's. So here the
archive's inlined graph (frozen, so that branches on its attributes are taken as they run) is
read: each selected module must be called once (one ``aten::lstm``,
``aten::gru``, ``aten::rnn_tanh`` or ``aten::rnn_relu`` on its weights), and each one after the
first must take the output sequence of the one before, through nothing but tuple plumbing, the
batch-dimension ``squeeze``/``unsqueeze`` of nn.LSTM's own code, ``contiguous``, dropout
(identity in inference) and sequence packing. Anything else on the way is named.
"""
from __future__ import annotations

from typing import Any

_RNN_OPS = frozenset({"aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu"})
# ops whose first input flows on unchanged in inference (for a served stack's [B, T, F] sequences)
_PASS = frozenset({"aten::contiguous", "aten::dropout", "aten::feature_dropout", "aten::alpha_dropout",
                   "aten::feature_alpha_dropout", "aten::squeeze", "aten::unsqueeze", "aten::_pack_padded_sequence",
                   "aten::_pad_packed_sequence", "aten::detach"})

_Source = tuple  # (rnn node, output index) | ("input",) | ("op", kind)


def _module_of(node: Any) -> str | None:
    """The module whose weights a recurrent op runs on (``GetAttr`` chain from the archive's root), "" for the root."""
    for value in node.inputs():
        producer = value.node()
        if producer.kind() == "prim::ListConstruct":  # traced: the weights one by one
            inputs = list(producer.inputs())
            if not inputs:
                continue
            value, producer = inputs[0], inputs[0].node()
        path = []
        while producer.kind() == "prim::GetAttr":
            path.append(producer.s("name"))
            value = producer.input()
            producer = value.node()
        if path:
            return ".".join(reversed(path[1:]))  # without the weight's (or _flat_weights') own name
    return None


def _sources(value: Any, index: int | None = None) -> set[_Source]:
    """Where ``value`` (element ``index`` of it, when it is a tuple) comes from, through pass-through ops."""
    node, kind = value.node(), value.node().kind()
    if index is not None:
        if kind == "prim::TupleConstruct":
            return _sources(list(node.inputs())[index])
        if kind == "prim::If":
            return set().union(*(_sources(list(b.returnNode().inputs())[value.offset()], index) for b in node.blocks()))
        return {("op", kind)}
    if kind in _RNN_OPS:
        return {(node, value.offset())}
    if kind == "prim::Param":
        return {("input",)}
    if kind == "prim::TupleUnpack":
        return _sources(node.input(), value.offset())
    if kind in ("prim::TupleIndex", "aten::__getitem__"):
        tup, at = list(node.inputs())
        if at.node().kind() == "prim::Constant":
            return _sources(tup, int(at.toIValue()))
        return {("op", kind)}
    if kind == "prim::If":
        return set().union(*(_sources(list(b.returnNode().inputs())[value.offset()]) for b in node.blocks()))
    if kind in _PASS and value.offset() == 0:
        return _sources(list(node.inputs())[0])
    return {("op", kind)}


def _graph(module: Any, stack: list[str]) -> Any:
    """The archive's forward with its submodules inlined, frozen where torch can: freezing folds the module's
    attributes into constants, so branches on them (``if self.use_head:``) are taken as they run, not read as
    code between the modules. The stacked modules stay attributes, whose weights name them."""
    import torch

    try:
        kept = sorted({prefix.split(".")[0] for prefix in stack if prefix})
        return torch.jit.freeze(module.eval(), preserved_attrs=kept).graph
    except Exception:  # noqa: BLE001 - torch cannot freeze every archive; its plain graph is read then
        return module.inlined_graph


def stack_problem(module: Any, stack: list[str]) -> str | None:
    """Why the archive ``module`` does not run ``stack`` (module prefixes, "" for the root) as a plain stack, or
    None when it does, or when its graph cannot be read (then nothing is claimed either way)."""
    if len(stack) < 2:
        return None
    try:
        nodes = list(_graph(module, stack).nodes())
        calls: dict[str, list[Any]] = {}
        for node in nodes:
            if node.kind() in _RNN_OPS:
                calls.setdefault(_module_of(node) or "", []).append(node)
    except Exception:  # noqa: BLE001 - a graph this reader does not know: the checks that ran stand
        return None
    shown = {prefix: f"'{prefix or '(root)'}'" for prefix in stack}
    for prefix in stack:
        if len(calls.get(prefix, [])) > 1:
            return f"its code calls {shown[prefix]} {len(calls[prefix])} times, and rnnserve serves it once"
    for before, after in zip(stack, stack[1:]):
        if len(calls.get(before, [])) != 1 or len(calls.get(after, [])) != 1:
            return None  # a call this reader cannot find (control flow, a custom cell): nothing to claim
        sources = _sources(list(calls[after][0].inputs())[0])
        if sources == {(calls[before][0], 0)}:
            continue
        ops = sorted({s[1] for s in sources if s[0] == "op"})
        if ops:
            what = f"through {', '.join(ops)}"
        elif ("input",) in sources:
            what = "from the archive's own input"
        else:
            what = "from a final state"
        return (f"its code feeds {shown[after]} {what}, not straight from the output sequence of {shown[before]} "
                f"as --select {','.join(stack)} serves it")
    return None
