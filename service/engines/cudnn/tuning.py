"""Timing each cuDNN RNN algorithm for one block at each batch bucket (see autotune for the policy)."""
from __future__ import annotations

import time

import numpy as np

from ...errors import EngineUnavailable
from . import library as L
from .autotune import LONG_FACTOR, AlgoTable, BucketChoice, ReplayLine, Trial, choose, host_call_ms, time_call
from .block import AlgorithmRejected, BlockRunner
from .transfer import Converter

# Persistent kernels lose ground as the batch grows; once one has lost to STANDARD at this many
# consecutive buckets it is not timed at larger ones (keeps load time down, PERSIST_DYNAMIC compiles).
GIVE_UP_AFTER = 2
LAYOUT_MARGIN = 0.05  # batch-major IO must be this much faster to be chosen over sequence-major


def tolerance(precision: str, allow_tf32: bool) -> float:
    """How far a persistent algorithm's outputs may be from STANDARD's to be used (relative to the outputs' scale)."""
    if precision == "float32":
        return 1e-2 if allow_tf32 else 1e-3
    return 5e-2 if precision == "float16" else 1.5e-1


def tune_table(runners: list[BlockRunner], conv: Converter, buckets: tuple[int, ...], steps: int,
               forced: int | None, autotune: bool, tol: float, graph: bool = False) -> AlgoTable:
    """The engine's algorithm table: every block timed at every bucket (see :func:`tune_block`), or STANDARD
    everywhere when not ``autotune``; ``forced``: the one algorithm a caller asked for (with STANDARD where
    it cannot run), refused with EngineUnavailable where it runs at no batch size."""
    if not autotune and forced in (None, L.ALGO_STANDARD):
        choices = [[BucketChoice(b, L.ALGO_STANDARD, None, {L.ALGO_STANDARD: Trial(L.ALGO_STANDARD)})
                    for b in buckets] for _ in runners]
        return AlgoTable(buckets, choices, steps, forced)
    if forced is not None:
        algos = (L.ALGO_STANDARD,) if forced == L.ALGO_STANDARD else (L.ALGO_STANDARD, forced)
    else:
        algos = (L.ALGO_STANDARD, L.ALGO_PERSIST_STATIC, L.ALGO_PERSIST_STATIC_SMALL_H, L.ALGO_PERSIST_DYNAMIC)
    choices = []
    long_steps = steps * LONG_FACTOR
    for runner in runners:
        trials = tune_block(runner, conv, buckets, steps, algos, tol, give_up=forced is None,
                            long_steps=long_steps, graph=graph)
        per = [choose(b, t, forced) for b, t in zip(buckets, trials)]
        if forced not in (None, L.ALGO_STANDARD) and all(c.algo != forced for c in per):
            errors = {c.trials[forced].error for c in per if forced in c.trials}
            raise EngineUnavailable(
                f"algorithm '{L.ALGO_NAMES[forced]}' cannot run block {runner.index} "
                f"({runner.spec.cell}, H={runner.spec.hidden_size}, proj={runner.spec.proj_size}) at any batch "
                f"size: {'; '.join(sorted(e for e in errors if e))}"
            )
        choices.append(per)
    return AlgoTable(buckets, choices, steps, forced, long_steps, graphs=graph)


def _as_float32(conv: Converter, a):
    return conv.from_store(a, np.float32)


def tune_block(runner: BlockRunner, conv: Converter, buckets: tuple[int, ...], steps: int,
               algos: tuple[int, ...], tolerance: float, give_up: bool = True,
               long_steps: int | None = None, graph: bool = False) -> list[dict[int, Trial]]:
    """Per bucket, a Trial for each of ``algos`` (STANDARD first: the others are checked against it).

    Each usable algorithm is timed at ``steps`` and, when given, again at ``long_steps``
    (the two points of its cost line; see autotune). With ``give_up`` an algorithm that lost
    to STANDARD at both lengths at GIVE_UP_AFTER consecutive buckets is not timed at larger
    ones; a forced algorithm is timed everywhere. ``graph``: time CUDA graph replays of the calls
    (the engine replays graphs of repeated shapes).
    """
    import cupy as cp

    ctx = runner.ctx
    spec = runner.spec
    rng = cp.random.RandomState(1234)
    losses = {a: 0 for a in algos}
    out: list[dict[int, Trial]] = []
    for bucket in buckets:
        x = conv.to_store(rng.uniform(-1.0, 1.0, (bucket, steps, spec.input_size), dtype=np.float32))
        h0 = conv.to_store(rng.uniform(-0.5, 0.5, (spec.pseudo_layers, bucket, spec.output_size), dtype=np.float32))
        lens_host = np.full(bucket, steps, dtype=np.int32)
        lens_dev = cp.asarray(lens_host)
        key = (bucket, steps, None)
        long = (_LongRun(runner, conv, rng, bucket, long_steps, graph)
                if long_steps and long_steps != steps else None)
        reference = None
        trials: dict[int, Trial] = {}
        for algo in algos:
            trial = trials[algo] = Trial(algo)
            if give_up and algo != L.ALGO_STANDARD and losses[algo] >= GIVE_UP_AFTER:
                trial.error = f"not timed: slower than standard at {GIVE_UP_AFTER} smaller buckets"
                continue
            y = cp.empty((bucket, steps, runner.out_features), dtype=conv.store)
            hy = cp.empty_like(h0)
            try:
                if algo == L.ALGO_PERSIST_DYNAMIC:
                    t0 = time.perf_counter()
                    runner.descriptor(algo, bucket)
                    trial.build_ms = (time.perf_counter() - t0) * 1000.0

                def run(algo=algo, y=y, hy=hy):
                    runner.forward(algo, bucket, steps, key, lens_host, lens_dev.data.ptr, x.data.ptr, y.data.ptr,
                                   h0.data.ptr, hy.data.ptr)

                trial.time_ms = time_call(run, ctx.stream, graph=graph)
                if graph:  # replays cost the GPU time; an uncaptured call (ragged lengths) also its launches
                    trial.host_ms = host_call_ms(run, ctx.stream)
            except (L.CudnnError, AlgorithmRejected) as exc:
                trial.error = str(exc)[:400]
                trial.time_ms = None
                if algo == L.ALGO_STANDARD:
                    raise
                losses[algo] += 1
                continue
            got = cp.concatenate([_as_float32(conv, y).ravel(), _as_float32(conv, hy).ravel()])
            if reference is None:
                reference = got
            else:
                scale = max(1.0, float(cp.abs(reference).max()))
                diff = float(cp.abs(got - reference).max())
                if not np.isfinite(diff) or diff > tolerance * scale:
                    trial.error = f"output differs from standard by {diff:.3g} (tolerance {tolerance * scale:.3g})"
                    trial.time_ms = None
                    losses[algo] += 1
                    continue
            if long is not None:
                try:
                    trial.long_ms, trial.long_host_ms = long.time(algo)
                except (L.CudnnError, AlgorithmRejected) as exc:
                    trial.error = f"failed at {long_steps} steps: {str(exc)[:300]}"
                    trial.time_ms = None
                    if algo == L.ALGO_STANDARD:
                        raise
                    losses[algo] += 1
                    continue
            if algo != L.ALGO_STANDARD:
                std = trials[L.ALGO_STANDARD]
                lost = std.time_ms is not None and trial.time_ms >= std.time_ms and (
                    trial.long_ms is None or std.long_ms is None or trial.long_ms >= std.long_ms)
                losses[algo] = losses[algo] + 1 if lost else 0
        out.append(trials)
    return out


class _LongRun:
    """Buffers for timing one bucket at the second tuning length."""

    def __init__(self, runner: BlockRunner, conv: Converter, rng, bucket: int, steps: int, graph: bool) -> None:
        import cupy as cp

        spec = runner.spec
        self.runner, self.bucket, self.steps, self.graph = runner, bucket, steps, graph
        self.x = conv.to_store(rng.uniform(-1.0, 1.0, (bucket, steps, spec.input_size), dtype=np.float32))
        self.h0 = conv.to_store(rng.uniform(-0.5, 0.5, (spec.pseudo_layers, bucket, spec.output_size),
                                            dtype=np.float32))
        self.y = cp.empty((bucket, steps, runner.out_features), dtype=conv.store)
        self.hy = cp.empty_like(self.h0)
        self.lens_host = np.full(bucket, steps, dtype=np.int32)
        self.lens_dev = cp.asarray(self.lens_host)

    def time(self, algo: int) -> tuple[float, float | None]:
        """(GPU ms, host ms of an uncaptured call or None when graphs are not timed) of ``algo``."""
        key = (self.bucket, self.steps, None)

        def run():
            self.runner.forward(algo, self.bucket, self.steps, key, self.lens_host, self.lens_dev.data.ptr,
                                self.x.data.ptr, self.y.data.ptr, self.h0.data.ptr, self.hy.data.ptr)

        stream = self.runner.ctx.stream
        gpu = time_call(run, stream, graph=self.graph)
        return gpu, (host_call_ms(run, stream) if self.graph else None)


def tune_layouts(table: AlgoTable, run_blocks, uniform, conv: Converter, input_size: int, steps: int, stream,
                 replay_ms=None) -> None:
    """Per bucket, time the whole model with batch-major IO and with sequence-major IO (our input
    transpose included) on the bucket's algorithms, and record the faster in ``table.layouts``.

    cuDNN takes both layouts; which is faster depends on the shape (sequence-major is what
    PyTorch uses). A layout whose call fails is not used. Batch-major must win by
    ``LAYOUT_MARGIN``: the two are often within timing noise of each other at load, and
    a noisy pick of batch-major left STANDARD-algorithm shapes 4-10 % behind PyTorch's
    sequence-major runs of the same kernel (H200 benchmark, 2026-11-22).

    ``replay_ms(n, t, algos, seq_major)`` (where the engine replays graphs; see
    :meth:`.graphs.GraphRuns.replay_ms`): each layout is timed as a graph replay at both tuning lengths,
    and the chosen layout's two times become the bucket's replay line (:attr:`AlgoTable.replay_lines`),
    which the planner then uses for its GPU time instead of the per-block lines (timed batch-major).
    Timed uncaptured instead, a STANDARD bucket's call is launch-bound, so both layouts read the same host
    time and the choice was noise (1.7-2.4 ms for each at every bucket from 8 rows, 2-layer H=256 and
    H=512 LSTMs, H100); replayed, they are 0.1-0.6 ms at 50 steps and 0.3-6.1 ms at 200.
    """
    import cupy as cp

    rng = cp.random.RandomState(4321)
    lengths = (table.steps, table.long_steps) if replay_ms is not None and table.long_steps != table.steps \
        else (table.steps,)
    for bucket in table.buckets:
        algos = [table.algos_for(bucket, t) for t in lengths]
        x = None
        times: dict[str, float | str] = {"timed": "replay" if replay_ms is not None else "uncaptured"}
        totals: dict[bool, float | None] = {}
        for seq_major in (False, True):
            name = "seq_major" if seq_major else "batch_major"
            got: list[float] = []
            try:
                for t, a in zip(lengths, algos):
                    ms = None if replay_ms is None else replay_ms(bucket, t, a, seq_major)
                    if ms is None:  # no graph of this shape: served uncaptured, so timed so
                        if x is None or x.shape[1] != t:
                            x = conv.to_store(rng.uniform(-1.0, 1.0, (bucket, t, input_size), dtype=np.float32))
                        lens = uniform(bucket, t)
                        ms = time_call(lambda: run_blocks(x, bucket, t, *lens, None, a, seq_major), stream, reps=5)
                        times["timed"] = "uncaptured"
                    got.append(ms)
            except (L.CudnnError, AlgorithmRejected) as exc:
                times[f"{name}_error"] = str(exc)[:200]
                totals[seq_major] = None
                continue
            times[f"{name}_ms"] = round(got[0], 4)
            if len(got) > 1:
                times[f"{name}_long_ms"] = round(got[1], 4)
            totals[seq_major] = sum(got)
        sm, bm = totals.get(True), totals.get(False)
        chosen = sm is not None and (bm is None or sm <= bm * (1 + LAYOUT_MARGIN))
        table.layouts[bucket] = (chosen, times)
        name = "seq_major" if chosen else "batch_major"
        if times["timed"] == "replay" and f"{name}_long_ms" in times:
            table.set_replay_line(bucket, ReplayLine(algos[0], algos[1], times[f"{name}_ms"],
                                                     times[f"{name}_long_ms"]))
