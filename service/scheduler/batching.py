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
from typing import Any, Callable

import numpy as np

from ..engines.state_pool import PooledRows, StatePool
from ..spec import RNNSpec
from ..wire import wire
from .rowcopy import copy_sequences

OUTPUT_NAMES = ("output", "output_last", "h_n", "c_n")


@dataclass
class SequenceWork:
    """One request's sequences, validated and ready to batch.

    x [B, T, I] float32, lengths [B] int64 (1..T), h0 [B, S, Ho] / c0 [B, Sc, H] float32
    or None, outputs: the output names to return.

    A chunk of a stateful stream (one sequence) sets ``pool`` and ``slot``: its final
    state goes to that slot of the engine's state pool, and, with ``resume``, its initial
    state comes from there (else from h0/c0, or zeros: a stream's first chunk). A batch
    with stream chunks runs through the engine's ``forward_pooled`` (``launch(...,
    pooled=)``), so states are gathered and scattered on the engine's device.
    """

    x: np.ndarray
    lengths: np.ndarray
    h0: np.ndarray | None = None
    c0: np.ndarray | None = None
    outputs: frozenset[str] = field(default_factory=lambda: frozenset(OUTPUT_NAMES))
    pool: StatePool | None = None
    slot: int = -1
    resume: bool = False

    def __reduce__(self) -> tuple:
        # Sent from front-end processes to the engine process (see service.wire); a stream's slot
        # never crosses: the engine process fills it in.
        return (SequenceWork, (wire(self.x), wire(self.lengths), wire(self.h0), wire(self.c0), self.outputs))

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
    """Engine arguments for several requests: x [N, Tmax, I], lengths [N], h0/c0 or None.

    ``x`` is a host array, or what an engine's ``input_rows`` made of the requests' inputs (see :func:`merge`).
    """

    x: Any
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


def merge(parts: list[SequenceWork], buffer: Callable[[tuple[int, int, int]], np.ndarray | None] | None = None,
          rows: Callable[[list[np.ndarray], int], Any] | None = None) -> MergedBatch:
    """Stack ``parts`` into one batch padded to the longest valid length; missing states are zeros.

    ``buffer(shape)``: where to build ``x`` (an engine's :meth:`~service.engines.base.Engine.input_buffer`,
    uninitialized; the padding is zeroed here), else a new zeroed array. ``rows(xs, t_max)``: an engine's
    ``input_rows``, which may take the parts' inputs as they lie instead (the GPU engine gathers them on
    the device, see :mod:`service.engines.cudnn.host_rows`); x is then what it returns, not an array.
    """
    t_max = max(p.steps for p in parts)
    if len(parts) == 1 and parts[0].x.shape[1] == t_max:
        # nothing to merge: a lone part goes as it is (also when rows could take it where it lies: on an H100
        # host, no-batching throughput was lower in 6 of 6 runs reading it from a mapped arena, by DMA or kernel)
        p = parts[0]
        return MergedBatch(p.x, p.lengths, p.h0, p.c0)
    n = sum(p.sequences for p in parts)
    lengths = np.concatenate([p.lengths for p in parts]).astype(np.int64, copy=False)
    h0 = _stack_states([p.h0 for p in parts], [p.sequences for p in parts])
    c0 = _stack_states([p.c0 for p in parts], [p.sequences for p in parts])
    gathered = rows([p.x for p in parts], t_max) if rows is not None else None
    if gathered is not None:
        return MergedBatch(gathered, lengths, h0, c0)
    feat = parts[0].x.shape[2]
    shape = (n, t_max, feat)
    x = buffer(shape) if buffer is not None else None
    zeroed = x is None
    if zeroed:
        x = np.zeros(shape, dtype=np.float32)
    row = 0
    for p in parts:
        steps = min(p.x.shape[1], t_max)
        copy_sequences(x, row, p.x, steps)
        if not zeroed and steps < t_max:
            x[row:row + p.sequences, steps:] = 0
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
    pooled = pooled_rows(parts)
    options = _options(engine, parts, pooled is not None)
    if pooled is not None:
        out = engine.forward_pooled(batch.x, batch.lengths, batch.h0, batch.c0, pooled, **options)
    else:
        out = engine.forward(batch.x, batch.lengths, batch.h0, batch.c0, **options)
    return batch, split_output(engine, batch, out, parts)


def launch_batch(engine: Any, parts: list[SequenceWork]) -> tuple[MergedBatch, Any]:
    """Merge and queue the batch on a launching engine (``launches``); returns it with the engine's Launched.

    The batch is merged into the engine's :meth:`~service.engines.base.Engine.input_buffer` (the GPU engine's
    pinned memory), which the launch copies to the device as it is.
    """
    batch = merge(parts, getattr(engine, "input_buffer", None), getattr(engine, "input_rows", None))
    pooled = pooled_rows(parts)
    options = _options(engine, parts, pooled is not None)
    if pooled is not None:
        options["pooled"] = pooled
    return batch, engine.launch(batch.x, batch.lengths, batch.h0, batch.c0, **options)


def finish_batch(engine: Any, batch: MergedBatch, launched: Any, parts: list[SequenceWork]
                 ) -> list[dict[str, np.ndarray]]:
    """The results of a batch from :func:`launch_batch`, once its Launched has been waited for."""
    return split_output(engine, batch, launched.finish(), parts)


def pooled_rows(parts: list[SequenceWork]) -> PooledRows | None:
    """The batch's stream rows (see :class:`SequenceWork`), or None when it holds no stream chunk."""
    pool = None
    reads: list[tuple[int, int]] = []
    writes: list[tuple[int, int]] = []
    row = 0
    for p in parts:
        if p.pool is not None:
            pool = p.pool if pool is None else pool
            if p.pool is not pool or p.sequences != 1:
                raise ValueError("stream chunks of one batch must be single sequences of one model's state pool")
            if p.resume:
                reads.append((p.slot, row))
            writes.append((row, p.slot))
        row += p.sequences
    return None if pool is None else PooledRows.of(pool, row, reads, writes)


def _options(engine: Any, parts: list[SequenceWork], pooled: bool = False) -> dict[str, bool]:
    """What the batch lets the engine skip: final states nobody reads, outputs other than the last steps."""
    options = {}
    if (pooled or getattr(engine, "skips_states", False)) and not any({"h_n", "c_n"} & p.outputs for p in parts):
        options["states_needed"] = False
    if getattr(engine, "computes_last", False) and not any("output" in p.outputs for p in parts):
        options["last_only"] = True
    return options


def split_output(engine: Any, batch: MergedBatch, out: Any, parts: list[SequenceWork]) -> list[dict[str, np.ndarray]]:
    """:func:`split` of an EngineOutput (host or CuPy arrays)."""
    return split(engine.spec, batch, _host(out.output), _host(out.h_n), _host(out.c_n), parts, _host(out.last))


def _host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a
