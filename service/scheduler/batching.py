"""Tensor merge and split for ragged batching: the only place that pads and un-pads.

A request's validated sequences are a :class:`SequenceWork`. :func:`merge` stacks
several of them into one engine batch padded to the batch's longest *valid* length
(client padding past the last length is not computed), and :func:`split` cuts the
engine's outputs back per request, re-padded with zeros to each request's own T,
gathering ``output_last`` on the way.

Engines compute each sequence over its own length only (packed-sequence
semantics), so a sequence's result does not depend on what it was batched with,
up to float32 rounding of differently sized GEMMs (~1e-7 relative).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..engines.base import BlockState, split_block_states, stack_block_states
from ..spec import RNNSpec
from ..wire import wire
from .rowcopy import copy_sequences

OUTPUT_NAMES = ("output", "output_last", "h_n", "c_n")


@dataclass
class SequenceWork:
    """One request's sequences, validated and ready to batch.

    x [B, T, I] float32, lengths [B] int64 (1..T), h0 [B, S, Ho] / c0 [B, Sc, H] float32
    or None, outputs: the output names to return.

    A chunk of a stateful stream sets ``stream``: its initial state is ``states`` (per
    block (h, c), the engine's own arrays, None = zeros), and after the batch ran
    ``states_out`` holds the per-block final state, still the engine's arrays (on the
    GPU for the cuDNN engine). A batch with any stream chunk runs through the engine's
    ``forward_blocks``, so states are gathered and scattered on the engine's device.
    """

    x: np.ndarray
    lengths: np.ndarray
    h0: np.ndarray | None = None
    c0: np.ndarray | None = None
    outputs: frozenset[str] = field(default_factory=lambda: frozenset(OUTPUT_NAMES))
    stream: bool = False
    states: list[BlockState] | None = None
    states_out: list[BlockState] | None = None

    def __reduce__(self) -> tuple:
        # Sent from front-end processes to the engine process (see service.wire); a stream's device
        # states never cross: the engine process fills them in.
        return (SequenceWork, (wire(self.x), wire(self.lengths), wire(self.h0), wire(self.c0), self.outputs,
                               self.stream))

    # Cached: the scheduler reads both for every waiting request on every batch it forms, and a
    # NumPy max costs microseconds (x and lengths do not change once the request is validated).
    @cached_property
    def sequences(self) -> int:
        """B: sequences in this request."""
        return int(self.x.shape[0])

    @cached_property
    def steps(self) -> int:
        """Longest valid length of this request (what it costs the engine in time steps)."""
        return int(self.lengths.max())


@dataclass
class MergedBatch:
    """Engine arguments for several requests: x [N, Tmax, I], lengths [N], h0/c0 or None."""

    x: np.ndarray
    lengths: np.ndarray
    h0: np.ndarray | None
    c0: np.ndarray | None

    @property
    def computed_steps(self) -> int:
        """N x Tmax: the padded work given to the engine."""
        return int(self.x.shape[0] * self.x.shape[1])

    @property
    def useful_steps(self) -> int:
        """Sum of lengths: the real work."""
        return int(self.lengths.sum())


def merge(parts: list[SequenceWork]) -> MergedBatch:
    """Stack ``parts`` into one batch padded to the longest valid length; missing states are zeros."""
    t_max = max(p.steps for p in parts)
    if len(parts) == 1 and parts[0].x.shape[1] == t_max:
        p = parts[0]
        return MergedBatch(p.x, p.lengths, p.h0, p.c0)
    n = sum(p.sequences for p in parts)
    feat = parts[0].x.shape[2]
    x = np.zeros((n, t_max, feat), dtype=np.float32)
    lengths = np.empty(n, dtype=np.int64)
    h0 = _stack_states([p.h0 for p in parts], [p.sequences for p in parts])
    c0 = _stack_states([p.c0 for p in parts], [p.sequences for p in parts])
    row = 0
    for p in parts:
        copy_sequences(x, row, p.x, min(p.x.shape[1], t_max))
        lengths[row:row + p.sequences] = p.lengths
        row += p.sequences
    return MergedBatch(x, lengths, h0, c0)


def _stack_states(states: list[np.ndarray | None], counts: list[int]) -> np.ndarray | None:
    present = [s for s in states if s is not None]
    if not present:
        return None
    shape = present[0].shape[1:]
    return np.concatenate(
        [s if s is not None else np.zeros((b,) + shape, np.float32) for s, b in zip(states, counts)], axis=0
    )


def output_last(spec: RNNSpec, output: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Many-to-one output [N, D*Ho]: each direction's output at its own final step.

    Forward runs end at ``length - 1``; a reverse direction (the second half of a
    bidirectional block, or a unidirectional block with variant ``reverse``) ends at step 0.
    """
    last = spec.blocks[-1]
    rows = np.arange(output.shape[0])
    if last.variant.get("reverse"):
        return np.ascontiguousarray(output[:, 0])
    result = output[rows, lengths - 1]
    if last.directions == 2:
        ho = last.output_size
        result[:, ho:] = output[:, 0, ho:]
    return np.ascontiguousarray(result)


def split(spec: RNNSpec, batch: MergedBatch, output: np.ndarray | None, h_n: Any, c_n: Any,
          parts: list[SequenceWork], last: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """Cut engine results back into one dict of requested outputs per part (float32).

    ``last``: the many-to-one outputs when the engine computed them (then ``output`` may be
    None, as long as no part asks for "output").
    """
    want_last = any("output_last" in p.outputs for p in parts)
    if last is not None:
        last = np.asarray(last, dtype=np.float32)
    elif want_last:
        last = output_last(spec, np.asarray(output, dtype=np.float32), batch.lengths)
    if output is not None:
        output = np.asarray(output, dtype=np.float32)
    results: list[dict[str, np.ndarray]] = []
    row = 0
    t_batch = 0 if output is None else output.shape[1]
    for p in parts:
        rows = slice(row, row + p.sequences)
        row += p.sequences
        res: dict[str, np.ndarray] = {}
        if "output" in p.outputs:
            t_req = p.x.shape[1]
            if t_req == t_batch:
                res["output"] = output[rows]
            else:
                out = np.zeros((p.sequences, t_req, output.shape[2]), np.float32)
                t = min(t_req, t_batch)
                out[:, :t] = output[rows, :t]
                res["output"] = out
        if last is not None and "output_last" in p.outputs:
            res["output_last"] = last[rows]
        if "h_n" in p.outputs and h_n is not None:
            res["h_n"] = np.asarray(h_n[rows], dtype=np.float32)
        if "c_n" in p.outputs and c_n is not None:
            res["c_n"] = np.asarray(c_n[rows], dtype=np.float32)
        results.append(res)
    return results


def run_batch(engine: Any, parts: list[SequenceWork]) -> tuple[MergedBatch, list[dict[str, np.ndarray]]]:
    """Merge, run the engine once, split: the body of one scheduler step (runs off the event loop)."""
    batch = merge(parts)
    if any(p.stream for p in parts):
        output, finals = engine.forward_blocks(batch.x, batch.lengths, _initial_states(engine, parts))
        return batch, _split_block_states(engine, batch, output, finals, parts)
    out = engine.forward(batch.x, batch.lengths, batch.h0, batch.c0, **_options(engine, parts))
    return batch, split_output(engine, batch, out, parts)


def launch_batch(engine: Any, parts: list[SequenceWork]) -> tuple[MergedBatch, Any]:
    """Merge and queue the batch on a launching engine (``launches``); returns it with the engine's Launched."""
    batch = merge(parts)
    if any(p.stream for p in parts):
        return batch, engine.launch_blocks(batch.x, batch.lengths, _initial_states(engine, parts))
    return batch, engine.launch(batch.x, batch.lengths, batch.h0, batch.c0, **_options(engine, parts))


def finish_batch(engine: Any, batch: MergedBatch, launched: Any, parts: list[SequenceWork]
                 ) -> list[dict[str, np.ndarray]]:
    """The results of a batch from :func:`launch_batch`, once its Launched has been waited for."""
    out = launched.finish()
    if any(p.stream for p in parts):
        output, finals = out
        return _split_block_states(engine, batch, output, finals, parts)
    return split_output(engine, batch, out, parts)


def _options(engine: Any, parts: list[SequenceWork]) -> dict[str, bool]:
    """What the batch lets the engine skip: final states nobody reads, outputs other than the last steps."""
    options = {}
    if getattr(engine, "skips_states", False) and not any({"h_n", "c_n"} & p.outputs for p in parts):
        options["states_needed"] = False
    if getattr(engine, "computes_last", False) and not any("output" in p.outputs for p in parts):
        options["last_only"] = True
    return options


def split_output(engine: Any, batch: MergedBatch, out: Any, parts: list[SequenceWork]) -> list[dict[str, np.ndarray]]:
    """:func:`split` of an EngineOutput (host or CuPy arrays)."""
    return split(engine.spec, batch, _host(out.output), _host(out.h_n), _host(out.c_n), parts, _host(out.last))


def _initial_states(engine: Any, parts: list[SequenceWork]) -> Any:
    """A batch holding stream chunks: its per-block initial states gathered on the engine, or None (all zeros)."""
    spec = engine.spec
    initial = [p.states if p.stream else (split_block_states(spec, p.h0, p.c0) if p.h0 is not None or p.c0 is not None
                                          else None) for p in parts]
    if all(s is None for s in initial):
        return None
    return engine.gather_states(initial, [p.sequences for p in parts])


def _split_block_states(engine: Any, batch: MergedBatch, output: Any, finals: Any, parts: list[SequenceWork]
                        ) -> list[dict[str, np.ndarray]]:
    """Results of a batch run with block states; each stream chunk keeps its rows of the new states."""
    spec = engine.spec
    h_n = c_n = None
    if any({"h_n", "c_n"} & p.outputs for p in parts):
        h_n, c_n = (_host(a) for a in stack_block_states(spec, finals))
    row = 0
    for p in parts:
        if p.stream:
            rows = slice(row, row + p.sequences)
            p.states_out = [(h[rows], None if c is None else c[rows]) for h, c in finals]
        row += p.sequences
    return split(spec, batch, _host(output), h_n, c_n, parts)


def _host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a
