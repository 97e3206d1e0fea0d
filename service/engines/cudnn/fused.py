"""Fused calls: an equal-length call's whole device work as one CUDA graph, its inputs and outputs one copy each.

A batch of stream chunks (a few 10-step chunks of different streams) costs the GPU ~0.3 ms
and the engine process's thread more. Profiled with py-spy on an H100 host under 256 paced
streams (bench/results/h100-2026-11-24/), launching such a batch through the general path
took ~0.47 ms of that thread in some thirty CuPy calls: allocations, staging x and the slot
index, the state slot gather and scatter kernels, the graph's device-to-device copies in and
out, the many-to-one kernel, the download. That thread is what every stream's chunk queues on.

A fused call captures all of it once per shape, over buffers the graph owns:

* ``inp``, one device buffer: x [n, t, I], each block's initial states h [rows, n, Ho] and
  c [rows, n, H], and the stream index [2, n] (int32: the slot each row reads, the slot it
  writes); the host packs them into a pinned slab of the graph's own and one copy moves them;
* the graph: the slot gather into the state buffers (rows that read no slot keep the h_0/c_0
  packed there, or get zeros), the blocks, the slot scatter of the final states, the
  many-to-one rows;
* ``out``, one device buffer: the output (the last rows [n, F], or y) and each block's final
  states, downloaded by one copy (the states only when the caller reads them).

The host packs, copies, launches, copies back and records an event. Calls replay graphs of
bucketed rows (see :mod:`.shape_buckets`): rows past the call's own carry index -1 (no slot
read or written) and nobody reads their outputs. Graphs are admitted, budgeted, rate-limited
and evicted with the engine's other graphs (:class:`.graphs.GraphRuns`); a state pool that
grows moves its arrays, and their addresses are part of the key, so graphs over the old
arrays are never replayed again (they age out).

Used for host inputs (arrays, or requests left in front-end arenas: :class:`.host_rows.HostRows`,
packed on the host here) on float32 and float16 engines, of equal lengths (stream chunks, single
requests) or a many-to-one batch of a causal model that the plan runs padded (requests of different
lengths, batched, or of one length: their lengths are packed with the inputs and pick each row's last
step inside the graph, and the graph's steps come from the step grid of :mod:`.shape_buckets`, so
that a few dozen graphs serve every length), of at most ``FUSED_MAX_BYTES`` of input (fused large
batches lost batched throughput: see there). Other calls take the engine's general path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...spec import RNNSpec
from ..base import EngineOutput, Launched
from ..state_pool import PooledRows
from .autotune import plan
from .block import AlgorithmRejected
from .copies import gather_slots, last_steps, scatter_slots, swap01
from .graphs import GraphRuns, capture, capture_errors
from .host_rows import HostRows

_ALIGN = 256
SLABS = 3  # pinned input slabs per graph; the scheduler keeps at most two calls in flight
_H2D, _D2H = 1, 2
# Calls with more input than this (counted as float32) take the general path. Fusing large batches lost batched
# throughput on H100 hosts (binary HTTP at concurrency 64, batches of ~18 requests of 20..200 steps: 14,202 vs
# 16,277 req/s packing them on the host, 12,516 vs 13,719 gathering them from the arenas inside the graph; the
# batches came out smaller; bench/results/h100-2026-11-24/). Small calls (stream chunks, single requests) are
# where the launches' host time is most of the call.
FUSED_MAX_BYTES = 64 << 10


def forward_cols(spec: RNNSpec, width: int) -> int:
    """Columns of the last block's output [.., width] that end at each sequence's last step (the rest
    belong to a reverse direction, which ends at step 0)."""
    last = spec.blocks[-1]
    if last.variant.get("reverse"):
        return 0
    return last.output_size if last.directions == 2 else width


@dataclass
class _Layout:
    """Named arrays packed back to back (each aligned) in one byte buffer."""

    entries: dict[str, tuple[int, tuple[int, ...], np.dtype]] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        dtype = np.dtype(dtype)
        self.entries[name] = (self.nbytes, tuple(shape), dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        self.nbytes += (size + _ALIGN - 1) // _ALIGN * _ALIGN

    def device(self, cp: Any, buf: Any, name: str) -> Any:
        off, shape, dtype = self.entries[name]
        return cp.ndarray(shape, dtype=dtype, memptr=buf.data + off)

    def host(self, mem: Any, name: str) -> np.ndarray:
        off, shape, dtype = self.entries[name]
        return np.frombuffer(mem, dtype=dtype, count=int(np.prod(shape)), offset=off).reshape(shape)

    def end(self, name: str) -> int:
        """Where ``name`` ends (bytes from the start)."""
        off, shape, dtype = self.entries[name]
        return off + int(np.prod(shape)) * dtype.itemsize


@dataclass(eq=False)
class _Slab:
    """Pinned host memory laid out as a graph's input buffer, with NumPy views of each part."""

    mem: Any
    views: dict[str, np.ndarray]
    event: Any                # recorded after the copy out of it: written again once that copy has run


@dataclass
class _Fused:
    graph: Any
    inp: Any                  # device bytes, laid out by ``ins``
    ins: _Layout
    slabs: list[_Slab]        # used in turn (see FusedCalls._stage)
    out: Any                  # device bytes, laid out by ``outs``
    outs: _Layout
    y: Any                    # the output region (GraphRuns.owns reads it)
    keep: list
    nbytes: int
    turn: int = 0


class FusedCalls:
    """One engine's fused calls (see the module docstring); ``launch`` returns None where it does not apply."""

    def __init__(self, cp: Any, ctx: Any, runners: list, spec: RNNSpec, store: np.dtype, graphs: GraphRuns,
                 blocking_sync: bool) -> None:
        self.cp = cp
        self.ctx = ctx
        self.runners = runners
        self.spec = spec
        self.store = np.dtype(store)
        self.graphs = graphs
        self.blocking_sync = blocking_sync
        self.replays = 0
        self._lstm = [blk.cell == "lstm" for blk in spec.blocks]

    def try_launch(self, checked: tuple, h0: Any, c0: Any, pooled: PooledRows | None, states_needed: bool,
                   last_only: bool, table: Any, shapes: Any, uniform: Any) -> Launched | None:
        """The engine's checked call (x, b, t, lens, out_dtype) as a fused graph, or None where that does not
        apply (yet). ``table``: the engine's AlgoTable; ``shapes``: its GraphShapes; ``uniform(n, t)``: its
        equal lengths (key, host, device)."""
        x, b, t, lens, out_dtype = checked
        if (not isinstance(x, (np.ndarray, HostRows)) or b > table.biggest
                or b * t * int(x.shape[2]) * 4 > FUSED_MAX_BYTES
                or not (h0 is None or isinstance(h0, np.ndarray)) or not (c0 is None or isinstance(c0, np.ndarray))):
            return None
        padded_ok = (last_only and not states_needed and pooled is None and h0 is None and c0 is None
                     and self.spec.causal)
        if int(lens.min()) == t and not padded_ok:
            n = shapes.rows(b, t)[0]
            return self.launch(x, b, t, (n, t), uniform(n, t), table.algos_for(n, t), table.seq_major_for(b),
                               h0, c0, pooled, states_needed, last_only, out_dtype)
        # A many-to-one batch of a causal model that the plan runs padded (see the engine's _run): the same, with
        # its lengths. Equal lengths too: single requests of 20..200 steps are 181 shapes, each captured only on its
        # second call and rate-limited, so most ran uncaptured; on the step grid a few dozen graphs serve them all.
        if not padded_ok:
            return None
        groups = plan(table, b, t, lens, True)
        if len(groups) != 1 or groups[0].rows is not None or not groups[0].uniform:
            return None
        shape = shapes.padded(b, t)
        return self.launch(x, b, t, shape, uniform(*shape), table.algos_for(*shape), groups[0].seq_major,
                           None, None, None, False, True, out_dtype, lengths=lens)

    def launch(self, x: np.ndarray | HostRows, b: int, t: int, shape: tuple[int, int], uniform: Any, algos: tuple,
               seq_major: bool, h0: np.ndarray | None, c0: np.ndarray | None, pooled: PooledRows | None,
               states_needed: bool, last_only: bool, out_dtype: np.dtype, lengths: np.ndarray | None = None
               ) -> Launched | None:
        """Queue the call (``b`` rows of ``t`` steps, run at ``shape``; ``uniform``: the engine's lengths
        (key, host, device) for ``shape``) and return without waiting, or None: no graph for it (yet).

        ``lengths``: the rows' own lengths of a ragged many-to-one call of a causal model, run padded to
        ``shape`` (every row to the graph's steps, see :func:`.autotune.plan`); the many-to-one rows are
        then picked at each row's own last step (the lengths travel with the inputs). Steps past a row's
        length compute on whatever the buffer holds and are never read.
        """
        n, steps = shape
        ragged = lengths is not None
        if ragged and not (last_only and not states_needed and pooled is None and h0 is None and c0 is None):
            raise ValueError("a ragged fused call is many-to-one without states")
        pool_key = None
        if pooled is not None:
            pooled.pool.reserve()
            pool_key = (pooled.pool.capacity,) + tuple(a.data.ptr for pair in pooled.pool.arrays for a in pair
                                                       if a is not None)
        h_in, c_in = h0 is not None or pooled is not None, c0 is not None or pooled is not None
        key = ("fused", n, steps, int(x.shape[2]), algos, seq_major, h0 is not None, c0 is not None, pool_key,
               last_only, ragged)
        got = self.graphs.find(key, lambda: self._capture(key, n, steps, int(x.shape[2]), uniform, algos, seq_major,
                                                          h_in, c_in, h0 is not None, c0 is not None, pooled,
                                                          last_only, ragged))
        if got is None:
            return None
        stream = self.ctx.stream
        self._stage(got, x, b, t, h0, c0, pooled, lengths, stream)
        got.graph.launch(stream)
        down = got.outs.nbytes if states_needed else got.outs.end("y")
        mem = self.cp.cuda.alloc_pinned_memory(max(down, 1))
        self.cp.cuda.runtime.memcpyAsync(mem.ptr, got.out.data.ptr, down, _D2H, stream.ptr)
        done = self.cp.cuda.Event(block=self.blocking_sync, disable_timing=True)
        done.record(stream)
        self.replays += 1
        self.graphs.replays += 1
        return Launched(done, lambda: self._finish(got, mem, b, seq_major, states_needed, last_only, out_dtype))

    def _stage(self, got: _Fused, x: np.ndarray | HostRows, b: int, t: int, h0: Any, c0: Any,
               pooled: PooledRows | None, lengths: np.ndarray | None, stream: Any) -> None:
        """Pack the call's inputs into the graph's next pinned slab and queue its copy into the graph's input buffer.

        Each graph has ``SLABS`` slabs (pinned host memory the size of its input buffer) with their
        views made at capture, used in turn: a pinned pool's block search and a view per part took over
        a third of a fused launch's host time (py-spy, H100 host). A slab whose last copy has not run
        yet (that many calls of this graph queued) is waited for.
        """
        slab = got.slabs[got.turn]
        got.turn = (got.turn + 1) % len(got.slabs)
        if not slab.event.done:
            slab.event.synchronize()
        views = slab.views
        x_h = views["x"]
        if isinstance(x, HostRows):  # the requests as they lie
            row = 0
            for src in x.sources:
                steps = min(src.shape[1], t)
                np.copyto(x_h[row:row + src.shape[0], :steps], src[:, :steps], casting="unsafe")
                row += src.shape[0]
        else:
            np.copyto(x_h[:b, :t], x, casting="unsafe")
        if lengths is not None:
            lens = views["lengths"]
            lens[:b] = lengths
            lens[b:] = 1
        for given, name in ((h0, "h"), (c0, "c")):
            if given is None:
                continue
            row = 0
            for k, blk_spec in enumerate(self.spec.blocks):
                if name == "c" and not self._lstm[k]:
                    continue
                rows = blk_spec.pseudo_layers
                np.copyto(views[f"{name}{k}"][:, :b], given[:, row:row + rows].transpose(1, 0, 2), casting="unsafe")
                row += rows
        if pooled is not None:
            index = views["index"]
            index[:, :b] = pooled.index
            index[:, b:] = -1
        self.cp.cuda.runtime.memcpyAsync(got.inp.data.ptr, slab.mem.ptr, got.ins.nbytes, _H2D, stream.ptr)
        slab.event.record(stream)

    def _slab(self, ins: _Layout) -> _Slab:
        mem = self.cp.cuda.alloc_pinned_memory(ins.nbytes)
        views = {name: ins.host(mem, name) for name in ins.entries}
        if "index" in views:
            views["index"] = views["index"].reshape(2, -1)
        return _Slab(mem, views, self.cp.cuda.Event(block=False, disable_timing=True))

    def _finish(self, got: _Fused, mem: Any, b: int, seq_major: bool, states_needed: bool, last_only: bool,
                out_dtype: np.dtype) -> EngineOutput:
        outs = got.outs
        y = outs.host(mem, "y")
        y = y[:b] if last_only or not seq_major else y.transpose(1, 0, 2)[:b]
        if y.dtype != out_dtype:
            y = y.astype(out_dtype)
        h_n = c_n = None
        if states_needed:
            h_n = self._states(outs, mem, "h", b, out_dtype) if self.spec.state_size is not None else None
            c_n = self._states(outs, mem, "c", b, out_dtype) if self.spec.cell_state_size is not None else None
        return EngineOutput(None, h_n, c_n, last=y) if last_only else EngineOutput(y, h_n, c_n)

    def _states(self, outs: _Layout, mem: Any, name: str, b: int, out_dtype: np.dtype) -> np.ndarray:
        """Batch-first [b, S, W] final states of every block (h) or every LSTM block (c)."""
        parts = [outs.host(mem, f"{name}{k}")[:, :b] for k in range(len(self.spec.blocks))
                 if name == "h" or self._lstm[k]]
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return np.ascontiguousarray(whole.transpose(1, 0, 2), dtype=out_dtype)

    def _capture(self, key: tuple, n: int, t: int, features: int, uniform: Any, algos: tuple, seq_major: bool,
                 h_in: bool, c_in: bool, h_given: bool, c_given: bool, pooled: PooledRows | None,
                 last_only: bool, ragged: bool) -> _Fused | None:
        cp, store, stream = self.cp, self.store, self.ctx.stream
        what = f"fused n={n} t={t}"
        started = time.perf_counter()
        lens_key, lens_host, lens_dev = uniform
        width = self.runners[-1].out_features
        ins, outs = _Layout(), _Layout()
        ins.add("x", (n, t, features), store)
        for k, blk in enumerate(self.spec.blocks):
            if h_in:
                ins.add(f"h{k}", (blk.pseudo_layers, n, blk.output_size), store)
            if c_in and self._lstm[k]:
                ins.add(f"c{k}", (blk.pseudo_layers, n, blk.hidden_size), store)
        if pooled is not None:
            ins.add("index", (2 * n,), np.int32)  # flat: reads, then writes (gather_slots takes an offset)
        if ragged:
            ins.add("lengths", (n,), np.int32)
        outs.add("y", (n, width) if last_only else ((t, n, width) if seq_major else (n, t, width)), store)
        for k, blk in enumerate(self.spec.blocks):
            outs.add(f"h{k}", (blk.pseudo_layers, n, blk.output_size), store)
        for k, blk in enumerate(self.spec.blocks):
            if self._lstm[k]:
                outs.add(f"c{k}", (blk.pseudo_layers, n, blk.hidden_size), store)
        try:
            inp = cp.zeros(ins.nbytes, cp.uint8)
            out = cp.zeros(outs.nbytes, cp.uint8)
            x_d = ins.device(cp, inp, "x")
            states = [(ins.device(cp, inp, f"h{k}") if h_in else None,
                       ins.device(cp, inp, f"c{k}") if c_in and self._lstm[k] else None)
                      for k in range(len(self.spec.blocks))]
            hys = [outs.device(cp, out, f"h{k}") for k in range(len(self.spec.blocks))]
            cys = [outs.device(cp, out, f"c{k}") if self._lstm[k] else None for k in range(len(self.spec.blocks))]
            y_out = outs.device(cp, out, "y")
            index = None
            if pooled is not None:
                index = ins.device(cp, inp, "index")
                # -1 everywhere (all bytes 0xff): the uncaptured warm-up below must not touch a slot
                cp.cuda.runtime.memsetAsync(index.data.ptr, 0xFF, index.nbytes, stream.ptr)
            ys = []
            for k, runner in enumerate(self.runners):
                if k == len(self.runners) - 1 and not last_only:
                    ys.append(y_out)
                else:
                    ys.append(cp.empty((t, n, runner.out_features) if seq_major else (n, t, runner.out_features),
                                       store))
            last_lens = lens_dev
            if ragged:
                last_lens = ins.device(cp, inp, "lengths")
                last_lens.set(np.ones(n, np.int32))  # valid steps for the uncaptured warm-up below
            x_seq = cp.empty((t, n, features), store) if seq_major else x_d
            work = max(r.work_size(a, n, t, lens_key, lens_host, seq_major) for r, a in zip(self.runners, algos))
            keep = [lens_dev, x_seq, *ys]
            nbytes = inp.nbytes + out.nbytes + sum(a.nbytes for a in ys[:-1]) + (x_seq.nbytes if seq_major else 0)
            if last_only:
                nbytes += ys[-1].nbytes
            ws = self.graphs.admit(key, nbytes, work)
            if ws is None:
                return None
            keep.append(ws)
            cols = forward_cols(self.spec, width)
            pools = pooled.pool.arrays if pooled is not None else None

            def enqueue() -> None:
                if pools is not None:
                    for k in range(len(self.runners)):
                        gather_slots(cp, pools[k], states[k], index, 0, n, (h_given, c_given and self._lstm[k]))
                inp_k = swap01(cp, x_d, out=x_seq) if seq_major else x_d
                for k, (runner, algo) in enumerate(zip(self.runners, algos)):
                    h, c = states[k]
                    runner.forward(algo, n, t, lens_key, lens_host, lens_dev.data.ptr, inp_k.data.ptr,
                                   ys[k].data.ptr, h.data.ptr if h is not None else 0, hys[k].data.ptr,
                                   c.data.ptr if c is not None else 0, cys[k].data.ptr if cys[k] is not None else 0,
                                   seq_major, workspace=ws.data.ptr)
                    inp_k = ys[k]
                if pools is not None:
                    for k in range(len(self.runners)):
                        scatter_slots(cp, (hys[k], cys[k]), pools[k], index, n, n)
                if last_only:
                    y_last = ys[-1].transpose(1, 0, 2) if seq_major else ys[-1]
                    last_steps(cp, y_last, last_lens, cols, out=y_out)

            enqueue()  # uncaptured first: descriptors, plans and kernels exist before the capture
            graph = capture(cp, stream, enqueue)
        except (*capture_errors(cp), ValueError, AlgorithmRejected) as exc:
            self.graphs.failed(key, what, exc)
            return None
        got = _Fused(graph, inp, ins, [self._slab(ins) for _ in range(SLABS)], out, outs, y_out, keep, nbytes)
        self.graphs.keep(key, got, started, what)
        return got
