"""Whether an ONNX state (or lengths) input that the notes call "the input itself" is what the recurrent nodes read.

A node's initial_h or initial_c that reaches a graph input only through ops that move values (Slice, Gather,
Split, Concat, Transpose, Cast, ...) is noted as "send that input per request as h_0/c_0" (:mod:`.onnx_nodes`).
Those ops can also reorder or cut it: a Slice with step -1 over H, a Gather that permutes H or swaps the layers'
states, a Cast to int and back. A client that follows the note then gets answers unlike the file's, while the
weights check out, because the whole-file probe feeds zero states (a verification probe found this).

So the file runs once more in onnxruntime, with random values in those inputs and the nodes' state inputs as
extra outputs. A note stands only when what the nodes read, stacked in the served layout h_0 [B, L*D, H] (or
[L*D, B, H], as torch exports it), holds the input's own values in the input's own order and shape. A note that
fails is replaced by one that says to send what the nodes read. Lengths picked from a graph input (sent as
'lengths', with no note) are checked the same way, with distinct lengths fed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import NodeProto, helper

from .onnx_graph import GraphIndex
from .verify import last_line


@dataclass
class StateClaim:
    """A note saying that node ``node``'s state input ``value`` (slot 5 initial_h, 6 initial_c) is graph input
    ``feed`` itself."""

    node: NodeProto
    slot: int          # 4 sequence_lens, 5 initial_h, 6 initial_c
    value: str
    feed: str
    note: str          # "" where the loader said nothing (lengths: sent as 'lengths')


def check_state_claims(path: Path, index: GraphIndex, claims: list[StateClaim], feeds: dict[str, np.ndarray],
                       notes: list[str], ort: Any, options: Any) -> dict[str, Any]:
    """Run the file with random state inputs (``feeds`` as the whole-file probe ran); replace the note of every
    claim that does not hold in ``notes`` (the provenance's list). Returns what the record says of the claims:
    ``{"state_inputs": {"as_sent": [...], "rearranged": [...]}}``, or ``{"state_inputs_unchecked": reason}``
    when they could not be checked, or {} when there were none."""
    top = {o for n in index.model.graph.node for o in n.output} | {i.name for i in index.model.graph.input}
    unchecked = [c for c in claims if c.value not in top or c.feed not in feeds
                 or feeds[c.feed].dtype.kind not in (("i", "u") if c.slot == 4 else ("f",))]
    claims = [c for c in claims if c not in unchecked]
    if not claims:
        return {"state_inputs_unchecked": "the recurrent nodes are inside a subgraph"} if unchecked else {}
    rng = np.random.default_rng(2468)
    feeds = dict(feeds)
    for feed, slot in {(c.feed, c.slot) for c in claims}:
        if slot == 4:  # distinct lengths in 1..T, so that a reordering shows (the probe fed T for every one)
            top_length = max(int(feeds[feed].max()), 1)
            feeds[feed] = (top_length - np.arange(feeds[feed].size) % top_length).reshape(feeds[feed].shape) \
                .astype(feeds[feed].dtype)
        else:
            feeds[feed] = (0.5 * rng.standard_normal(feeds[feed].shape)).astype(feeds[feed].dtype)
    extra = list(dict.fromkeys(c.value for c in claims if c.value not in feeds))
    try:
        model = onnx.load(str(path))  # external data too: the copy runs from bytes
        model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in extra)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        read = dict(zip(extra, session.run(extra, feeds)))
    except Exception as exc:  # noqa: BLE001 - a copy that does not run leaves the notes as they are, said so
        return {"state_inputs_unchecked": f"onnxruntime did not run the file with its states as outputs: "
                                          f"{last_line(exc)}"}
    read.update(feeds)
    as_sent, rearranged = [], []
    groups: dict[tuple[str, int], list[StateClaim]] = {}
    for claim in claims:
        groups.setdefault((claim.feed, claim.slot), []).append(claim)
    for (feed, slot), group in groups.items():
        label = {4: "sequence_lens", 5: "initial_h", 6: "initial_c"}[slot]
        if _holds(feeds[feed], [(c.node, np.asarray(read[c.value])) for c in group], index):
            as_sent.append(f"{feed} ({label})")
            continue
        rearranged.append(f"{feed} ({label})")
        served = {4: "lengths", 5: "h_0", 6: "c_0"}[slot]
        for claim in group:
            note = (f"node '{index.name(claim.node)}': {label} is graph input '{feed}' taken through "
                    f"{_path_ops(index, claim.value, feed)}, which do not pass it on as it is (the node reads its "
                    f"values reordered, cut, repeated or rounded): send per request as {served} the values the node "
                    f"reads, not '{feed}' itself")
            if claim.note in notes:
                notes[notes.index(claim.note)] = note
            else:
                notes.append(note)
    out: dict[str, Any] = {"state_inputs": {"as_sent": as_sent, "rearranged": rearranged}}
    if unchecked:
        out["state_inputs_unchecked"] = "some recurrent nodes are inside a subgraph"
    return out


def _holds(fed: np.ndarray, reads: list[tuple[NodeProto, np.ndarray]], index: GraphIndex) -> bool:
    """Whether the nodes' reads, stacked in chain order as [B, rows, H] (layout 1 nodes read [B, D, H], layout 0
    ones [D, B, H]), are ``fed`` itself as [B, rows, H] or [rows, B, H]; lengths [B]: each node reads ``fed``."""
    if all(value.ndim == 1 for _, value in reads):
        return all(np.array_equal(np.asarray(fed).astype(value.dtype).reshape(-1), value) for _, value in reads)
    rows = []
    for node, value in reads:
        if value.ndim != 3:
            return False
        rows.append(value if int(index.attr(node, "layout", 0)) == 1 else value.transpose(1, 0, 2))
    if len({r.shape[0] for r in rows}) != 1 or len({r.shape[2] for r in rows}) != 1:
        return False
    stacked = np.concatenate(rows, axis=1)
    fed = np.asarray(fed).astype(stacked.dtype)
    return any(fed.squeeze().shape == form.squeeze().shape and np.array_equal(fed.squeeze(), form.squeeze())
               for form in (stacked, stacked.transpose(1, 0, 2)))


def _path_ops(index: GraphIndex, value: str, feed: str) -> str:
    """The ops between graph input ``feed`` and ``value``, as "Slice 'n1', Gather 'n2'" (graph order)."""
    found: list[NodeProto] = []
    seen: set[str] = set()
    todo = [value]
    while todo:
        name = todo.pop()
        if name in seen or name not in index.producer:
            continue
        seen.add(name)
        node, _ = index.producer[name]
        if any(feed in index.feeding(i) for i in node.input if i):
            found.append(node)
            todo.extend(i for i in node.input if i)
    order = {id(n): k for k, n in enumerate(index.nodes)}
    shown = [f"{n.op_type} '{index.name(n)}'" for n in sorted(found, key=lambda n: order.get(id(n), 0))]
    return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "") or "its graph"
