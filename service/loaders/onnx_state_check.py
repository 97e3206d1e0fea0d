"""Whether an ONNX state (or lengths) input that the notes call "the input itself" is what the recurrent nodes read.

A node's initial_h or initial_c that reaches a graph input only through ops that move values (Slice, Gather,
Split, Concat, Transpose, Cast, ...) is noted as "send that input per request as h_0/c_0" (:mod:`.onnx_nodes`).
Those ops can also reorder or cut it: a Slice with step -1 over H, a Gather that permutes H or swaps the layers'
states, a Cast to int and back. A client that follows the note then gets answers unlike the file's, while the
weights check out, because the whole-file probe feeds zero states (a verification probe found this).

So the file runs once more in onnxruntime, with random values in those inputs and the nodes' state inputs as
extra outputs. A note stands only when what the nodes read, stacked in the served layout h_0 [B, L*D, H], is the
input's own values in their own order: as it is, transposed from [L*D, B, H] (as torch exports it) or reshaped
from [B, L*D*H]. Such a note is rewritten to say which of those and which rows of h_0/c_0 the input fills; a
note that fails is replaced by one that says to send what the nodes read; a note that could not be checked (the
file does not run in onnxruntime, a subgraph, sizes the probe guessed) says so. Lengths picked from a graph
input (sent as 'lengths', with no note) are checked the same way, with distinct lengths fed.
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


def check_state_claims(path: Path, index: GraphIndex, chain: list[NodeProto], claims: list[StateClaim],
                       feeds: dict[str, np.ndarray], guessed: list[str], notes: list[str], ort: Any,
                       options: Any) -> dict[str, Any]:
    """Run the file with random state inputs and distinct lengths (``feeds`` as the whole-file probe ran them;
    ``guessed``: the inputs whose sizes the probe guessed) and rewrite every claim's note in ``notes`` (the
    provenance's list) to say how to send the input: as it is or transposed, which rows of h_0/c_0, or that
    the nodes read something else. Returns the record's ``state_inputs`` ({"as_sent": [...], "rearranged":
    [...]}) and ``state_inputs_unchecked`` (why some claims could not be checked; their notes say so too)."""
    top = {o for n in index.model.graph.node for o in n.output} | {i.name for i in index.model.graph.input}
    skipped: dict[str, list[StateClaim]] = {}
    runnable = []
    for claim in claims:
        fed = feeds.get(claim.feed)
        kinds = ("i", "u", "f") if claim.slot == 4 else ("f",)  # lengths declared float are whole numbers too
        if claim.value not in top:
            skipped.setdefault("the node is inside a subgraph", []).append(claim)
        elif fed is None or fed.dtype.kind not in kinds:
            what = "lengths" if claim.slot == 4 else "a float state"
            skipped.setdefault(f"'{claim.feed}' is not {what} the probe can vary", []).append(claim)
        elif claim.slot == 4 and (fed.size < 2 or int(fed.max()) < 2):
            skipped.setdefault(f"the probe could not give '{claim.feed}' distinct lengths (it ran at batch or "
                               f"time 1)", []).append(claim)
        else:
            runnable.append(claim)
    out: dict[str, Any] = {}
    if runnable:
        found = _run(path, index, runnable, feeds, ort, options)
        if isinstance(found, str):
            skipped.setdefault(found, []).extend(runnable)
        else:
            out["state_inputs"] = _judge(index, chain, runnable, found, guessed, notes, skipped)
    for reason, group in skipped.items():
        unchecked_claims(index, group, notes, reason)
    if skipped:
        out["state_inputs_unchecked"] = "; ".join(skipped)
    return out


def unchecked_claims(index: GraphIndex, claims: list[StateClaim], notes: list[str], reason: str) -> dict[str, Any]:
    """Say in ``notes`` that these claims were not checked on the file, and why: a state note gets the caveat, and
    lengths picked through ops (which have no note) get one. Returns the record's ``state_inputs_unchecked``."""
    readers: dict[tuple[str, int], int] = {}
    for claim in claims:
        readers[claim.feed, claim.slot] = readers.get((claim.feed, claim.slot), 0) + 1
    for claim in claims:
        shared = readers[claim.feed, claim.slot]
        if claim.value == claim.feed and shared == 1:
            continue  # the node reads the graph input itself: nothing between them to reorder it
        if claim.value == claim.feed:
            caveat = (f"not checked on the file ({reason}): '{claim.feed}' is read whole by {shared} nodes, so "
                      f"send it once in each node's rows of {_SERVED[claim.slot]}")
        else:
            caveat = (f"not checked on the file ({reason}): if {_path_ops(index, claim.value, claim.feed)} "
                      f"reorder, cut, repeat or round '{claim.feed}', send the values the node reads instead")
        if claim.note in notes:
            notes[notes.index(claim.note)] = claim.note = f"{claim.note}; {caveat}"
        elif claim.slot == 4:
            claim.note = (f"node '{index.name(claim.node)}': sequence_lens comes from graph input '{claim.feed}' "
                          f"through {_path_ops(index, claim.value, claim.feed)}; send it per request as lengths, "
                          f"{caveat}")
            notes.append(claim.note)
    return {"state_inputs_unchecked": reason}


def _run(path: Path, index: GraphIndex, claims: list[StateClaim], feeds: dict[str, np.ndarray], ort: Any,
         options: Any) -> dict[str, np.ndarray] | str:
    """The feeds (random states, distinct lengths) and the values the nodes read, by name; or why the file did
    not run."""
    rng = np.random.default_rng(2468)
    feeds = dict(feeds)
    for feed, slot in sorted({(c.feed, c.slot) for c in claims}):
        fed = feeds[feed]
        if slot == 4:  # distinct lengths in 1..T, so that a reordering shows (the probe fed T for every one)
            top_length = int(fed.max())
            feeds[feed] = (top_length - np.arange(fed.size) % top_length).reshape(fed.shape).astype(fed.dtype)
        else:
            feeds[feed] = (0.5 * rng.standard_normal(fed.shape)).astype(fed.dtype)
    extra = list(dict.fromkeys(c.value for c in claims if c.value not in feeds))
    try:
        model = onnx.load(str(path))  # external data too: the copy runs from bytes
        model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in extra)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        read = dict(zip(extra, session.run(extra, feeds)))
    except Exception as exc:  # noqa: BLE001 - a copy that does not run leaves the notes unchecked, said so
        return f"onnxruntime did not run the file with its states as outputs: {last_line(exc)}"
    return {**feeds, **read}


def _judge(index: GraphIndex, chain: list[NodeProto], claims: list[StateClaim], read: dict[str, np.ndarray],
           guessed: list[str], notes: list[str],
           skipped: dict[str, list[StateClaim]]) -> dict[str, list[str]]:
    """Each (input, slot) group's verdict, its notes rewritten; claims the probe's guessed sizes leave open go to
    ``skipped``."""
    as_sent, rearranged = [], []
    groups: dict[tuple[str, int], list[StateClaim]] = {}
    for claim in claims:
        groups.setdefault((claim.feed, claim.slot), []).append(claim)
    for (feed, slot), group in groups.items():
        label = _LABELS[slot]
        reads = [(c.node, np.asarray(read[c.value])) for c in group]
        form = _form(read[feed], reads, index)
        if form is None and feed in guessed and read[feed].size != sum(r.size for _, r in reads):
            # the probe guessed this input's sizes (another batch symbol than X's): a broadcast may be the guess's
            skipped.setdefault(f"the probe guessed the sizes of '{feed}'", []).extend(group)
            continue
        if form is None:
            rearranged.append(f"{feed} ({label})")
            _rearranged(index, group, feed, slot, notes)
            continue
        as_sent.append(f"{feed} ({label})")
        if slot != 4:
            _as_sent(index, chain, group, feed, slot, form, notes)
    return {"as_sent": as_sent, "rearranged": rearranged}


_LABELS = {4: "sequence_lens", 5: "initial_h", 6: "initial_c"}
_SERVED = {4: "lengths", 5: "h_0", 6: "c_0"}


def _rearranged(index: GraphIndex, group: list[StateClaim], feed: str, slot: int, notes: list[str]) -> None:
    for claim in group:
        if claim.value == feed:
            how = (f"is graph input '{feed}' itself, which {len(group)} nodes read whole, so it does not fill "
                   f"{_SERVED[slot]} (rows per node)")
        else:
            how = (f"is graph input '{feed}' taken through {_path_ops(index, claim.value, feed)}, which do not pass it "
                   f"on as it is (the node reads its values reordered, cut, repeated or rounded)")
        note = (f"node '{index.name(claim.node)}': {_LABELS[slot]} {how}: send per request as {_SERVED[slot]} the "
                f"values the node reads, not '{feed}' itself")
        if claim.note in notes:
            notes[notes.index(claim.note)] = note
        else:
            notes.append(note)
        claim.note = note


def _as_sent(index: GraphIndex, chain: list[NodeProto], group: list[StateClaim], feed: str, slot: int, form: str,
             notes: list[str]) -> None:
    """Rewrite the group's notes to say where ``feed`` goes in h_0/c_0: which rows, in which form."""
    served = _SERVED[slot]
    takers = [n for n in chain if slot == 5 or n.op_type == "LSTM"]  # c_0 has rows for LSTM layers only
    widths = {int(index.attr(n, "hidden_size")) for n in takers}
    rows, where = 0, {}
    for node in takers:
        d = 2 if index.attr(node, "direction", b"forward") in (b"bidirectional", "bidirectional") else 1
        where[id(node)] = (rows, rows + d)
        rows += d
    mine = [where[id(c.node)] for c in group if id(c.node) in where]
    if len(widths) > 1:
        how = (f"rnnserve serves this model without {served} (its layers' state widths differ, "
               f"{sorted(widths)}), so it starts from zeros: the file's '{feed}' cannot be sent")
    elif mine and mine[0][0] == 0 and mine[-1][1] == rows and len(mine) == len(takers):
        how = f"send it per request as {served} [B, {rows}, H], {form}"
    else:
        span = f"rows {mine[0][0]}..{mine[-1][1] - 1}" if mine else "its rows"
        how = (f"send it per request as {span} of {served} [B, {rows}, H], {form}; the other rows are what the "
               f"other layers start from (zeros where the file gives them none)")
    for claim in group:
        note = f"node '{index.name(claim.node)}': {_LABELS[slot]} comes from graph input '{feed}': {how}"
        if claim.note in notes:
            notes[notes.index(claim.note)] = note
        claim.note = note


def _form(fed: np.ndarray, reads: list[tuple[NodeProto, np.ndarray]], index: GraphIndex) -> str | None:
    """How ``fed`` holds the nodes' reads, or None when it does not: reads stacked in chain order as [B, rows, H]
    (layout 1 nodes read [B, D, H], layout 0 ones [D, B, H]) are ``fed`` as it is, transposed from
    [rows, B, H], or reshaped from [B, rows*H]; lengths [B]: each node reads ``fed``."""
    if all(value.ndim == 1 for _, value in reads):
        same = all(np.array_equal(np.asarray(fed).astype(value.dtype).reshape(-1), value) for _, value in reads)
        return "as it is" if same else None
    rows = []
    for node, value in reads:
        if value.ndim != 3:
            return None
        rows.append(value if int(index.attr(node, "layout", 0)) == 1 else value.transpose(1, 0, 2))
    if len({r.shape[0] for r in rows}) != 1 or len({r.shape[2] for r in rows}) != 1:
        return None
    stacked = np.concatenate(rows, axis=1)  # [B, rows, H]
    fed = np.asarray(fed).astype(stacked.dtype)
    b, n, h = stacked.shape
    forms = (("as it is (batch first)", stacked), (f"transposed from [{n}, B, {h}] as torch exports it",
                                                   stacked.transpose(1, 0, 2)))
    for text, form in forms:
        if fed.squeeze().shape == form.squeeze().shape and np.array_equal(fed.squeeze(), form.squeeze()):
            return text
    if fed.size == stacked.size and fed.ndim >= 1 and fed.shape[0] == b and b != n \
            and np.array_equal(fed.reshape(b, n, h), stacked):
        return f"reshaped from [B, {', '.join(map(str, fed.shape[1:]))}] to [B, {n}, {h}]"
    return None


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
