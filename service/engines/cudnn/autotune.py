"""Choosing a cuDNN RNN algorithm per batch-size bucket, and planning each call.

At load the engine times every algorithm cuDNN accepts for each block and each
batch bucket (1, 2, 4, ... up to max_batch_size) on ``steps`` (default 50) steps of
random data, and keeps the fastest. An algorithm is used only if it also
reproduces STANDARD's output on that data (a silently wrong kernel is worse than a
slow one), and a persistent algorithm must beat STANDARD by 5% to be chosen, since
it comes with constraints (below). PERSIST_DYNAMIC is compiled for one exact batch
size, so a batch that is not exactly its bucket uses the bucket's best other
algorithm.

Persistent algorithms need every sequence of a call to have the same length and
no projection (measured on cuDNN 9.19). For a call with ragged lengths, or a batch
larger than the biggest bucket, :func:`plan` decides between

* one STANDARD call over the whole batch (padded to the longest sequence), and
* equal-length groups (one per distinct length, cut into pieces no larger than the
  biggest bucket), each run with its bucket's algorithm, then scattered back, and
* when the caller allows it (causal model, final states not wanted), the whole batch
  run at the longest length with the bucket's algorithm: persistent kernels run all
  steps in one launch, where STANDARD launches kernels per step (at H=128 and 200 steps
  ~2 ms of host time per call, measured on an H200),

by estimating each from the measured per-step times (time per step scales with
the steps run; groups pay a fixed gather/scatter cost each). With typical ragged
traffic (many distinct lengths) the whole-batch STANDARD call wins; equal-length
groups win when a few lengths repeat, e.g. a streaming client's fixed chunks.
"""
from __future__ import annotations

import statistics
from functools import cached_property
from dataclasses import dataclass, field

import numpy as np

from . import library as L

PERSISTENT_MARGIN = 0.95      # a persistent algorithm must take < 95% of STANDARD's time
GROUP_OVERHEAD_MS = 0.03      # gather + scatter + launches per equal-length group (estimate)
MAX_GROUPS = 32


def batch_buckets(max_batch_size: int, buckets: tuple[int, ...] | list[int] | None = None) -> tuple[int, ...]:
    """Powers of two up to ``max_batch_size``, plus ``max_batch_size`` itself; or the given sorted ``buckets``."""
    if buckets:
        out = sorted({int(b) for b in buckets})
        if out[0] < 1:
            raise ValueError(f"batch buckets must be >= 1, got {out}")
        return tuple(out)
    out = []
    b = 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    out.append(int(max_batch_size))
    return tuple(out)


@dataclass
class Trial:
    """One algorithm at one bucket: its median time, or why it was not usable."""

    algo: int
    time_ms: float | None = None
    error: str | None = None
    build_ms: float | None = None

    def to_dict(self) -> dict:
        d = {"algo": L.ALGO_NAMES[self.algo]}
        if self.time_ms is not None:
            d["time_ms"] = round(self.time_ms, 4)
        if self.build_ms is not None:
            d["build_ms"] = round(self.build_ms, 1)
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class BucketChoice:
    """The algorithm kept for one (block, bucket), with every trial."""

    bucket: int
    algo: int
    time_ms: float | None
    trials: dict[int, Trial] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"bucket": self.bucket, "algo": L.ALGO_NAMES[self.algo],
                "time_ms": None if self.time_ms is None else round(self.time_ms, 4),
                "tried": [t.to_dict() for t in self.trials.values()]}


def choose(bucket: int, trials: dict[int, Trial], forced: int | None = None) -> BucketChoice:
    """Keep the fastest usable trial; persistent ones must beat STANDARD by the margin."""
    ok = {a: t for a, t in trials.items() if t.time_ms is not None and not t.error}
    std = ok.get(L.ALGO_STANDARD)
    if forced is not None and forced in ok:
        return BucketChoice(bucket, forced, ok[forced].time_ms, trials)
    if std is None:
        return BucketChoice(bucket, L.ALGO_STANDARD, None, trials)
    best = std
    for algo, trial in ok.items():
        if algo != L.ALGO_STANDARD and trial.time_ms < PERSISTENT_MARGIN * std.time_ms and trial.time_ms < best.time_ms:
            best = trial
    return BucketChoice(bucket, best.algo, best.time_ms, trials)


@dataclass(frozen=True)
class Group:
    """Part of a call run as one cuDNN call per block: ``rows`` (None = whole batch, a slice or an index array)."""

    rows: object
    n: int
    steps: int
    algos: tuple[int, ...]
    uniform: bool
    seq_major: bool = False


class AlgoTable:
    """Per block, per bucket: the chosen algorithm and measured times (ms for ``steps`` steps)."""

    def __init__(self, buckets: tuple[int, ...], choices: list[list[BucketChoice]], steps: int,
                 forced: int | None = None) -> None:
        self.buckets = buckets
        self.choices = choices
        self.steps = max(1, int(steps))
        self.forced = forced
        self.biggest = buckets[-1]
        self.any_persistent = any(c.algo != L.ALGO_STANDARD for per in choices for c in per)
        self._by_bucket = [{c.bucket: c for c in per} for per in choices]
        # bucket -> (seq_major chosen, {"batch_major": ms, "seq_major": ms}); batch-major when untimed
        self.layouts: dict[int, tuple[bool, dict[str, float | str]]] = {}

    def seq_major_for(self, n: int) -> bool:
        """Whether calls of ``n`` equal-length sequences run in cuDNN's sequence-major layout."""
        hit = self.layouts.get(self.bucket_for(n))
        return bool(hit and hit[0])

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.biggest

    def algos_for(self, n: int) -> tuple[int, ...]:
        """Algorithms for an equal-length batch of ``n`` (n <= biggest bucket)."""
        bucket = self.bucket_for(n)
        out = []
        for per in self._by_bucket:
            choice = per[bucket]
            algo = choice.algo
            if algo == L.ALGO_PERSIST_DYNAMIC and n != bucket and self.forced != algo:
                others = [t for a, t in choice.trials.items()
                          if a != L.ALGO_PERSIST_DYNAMIC and t.time_ms is not None and not t.error]
                algo = min(others, key=lambda t: t.time_ms).algo if others else L.ALGO_STANDARD
            out.append(algo)
        return tuple(out)

    @cached_property
    def min_step_ms(self) -> float:
        """A lower bound of any call's ms per step: per block, the fastest time of any bucket and algorithm."""
        total = 0.0
        for k, per in enumerate(self.choices):
            total += min(self.step_ms(k, algo, c.bucket) for c in per
                         for algo in {c.algo, *(a for a, t in c.trials.items() if t.time_ms is not None)})
        return total

    def step_ms(self, block: int, algo: int, n: int) -> float:
        """Estimated ms per step for ``n`` sequences (linear beyond the biggest bucket)."""
        choice = self._by_bucket[block][self.bucket_for(n)]
        trial = choice.trials.get(algo)
        ms = trial.time_ms if trial is not None and trial.time_ms is not None else None
        if ms is None:
            ms = choice.time_ms if choice.time_ms is not None else 1.0
        ms /= self.steps
        if n > self.biggest:
            ms *= n / self.biggest
        return ms

    def describe(self) -> list[dict]:
        return [{"block": k, "buckets": [c.to_dict() for c in per]} for k, per in enumerate(self.choices)]

    def describe_layouts(self) -> list[dict]:
        return [{"bucket": b, "layout": "seq_major" if self.seq_major_for(b) else "batch_major",
                 **(self.layouts[b][1] if b in self.layouts else {})} for b in self.buckets]


def plan(table: AlgoTable, batch: int, steps: int, lengths: np.ndarray, pad_ok: bool = False) -> list[Group]:
    """Split one call into groups; see the module docstring for the decision.

    ``pad_ok``: the caller accepts a ragged batch run at the full ``steps`` for every
    sequence (causal model, final states not wanted), one more option to weigh.
    """
    blocks = len(table.choices)
    standard = (L.ALGO_STANDARD,) * blocks
    full = bool(lengths.min() == steps)
    if full and batch <= table.biggest:
        return [Group(None, batch, steps, table.algos_for(batch), True, table.seq_major_for(batch))]
    whole = [Group(None, batch, steps, standard, full, table.seq_major_for(batch))]
    if not table.any_persistent:
        return whole
    whole_cost = sum(table.step_ms(k, L.ALGO_STANDARD, batch) for k in range(blocks)) * int(lengths.max())
    options: list[tuple[float, list[Group]]] = [(whole_cost, whole)]
    if pad_ok and batch <= table.biggest and table.forced is None:
        algos = table.algos_for(batch)
        padded_cost = sum(table.step_ms(k, a, batch) for k, a in enumerate(algos)) * steps
        options.append((padded_cost, [Group(None, batch, steps, algos, True, table.seq_major_for(batch))]))
    values, inverse = np.unique(lengths, return_inverse=True)
    if table.forced is None:
        # At least one group per distinct length, none faster per step than the fastest bucket: when even
        # that bound loses, building the groups (Python work per group on every ragged call) is skipped.
        bound = table.min_step_ms * float(values.sum()) + GROUP_OVERHEAD_MS * values.size
        if values.size > MAX_GROUPS or bound >= min(cost for cost, _ in options):
            return min(options, key=lambda o: o[0])[1]
    groups: list[Group] = []
    cost = 0.0
    for i, length in enumerate(values):
        idx = np.flatnonzero(inverse == i)
        for start in range(0, idx.size, table.biggest):
            rows = idx[start:start + table.biggest]
            n = int(rows.size)
            if rows[-1] - rows[0] + 1 == n:
                rows = slice(int(rows[0]), int(rows[-1]) + 1)
            algos = table.algos_for(n)
            groups.append(Group(rows, n, int(length), algos, True, table.seq_major_for(n)))
            cost += sum(table.step_ms(k, a, n) for k, a in enumerate(algos)) * int(length) + GROUP_OVERHEAD_MS
        if len(groups) > MAX_GROUPS and table.forced is None:
            break
    if table.forced is not None:
        return groups
    if len(groups) <= MAX_GROUPS:
        options.append((cost, groups))
    return min(options, key=lambda o: o[0])[1]


def time_call(run, stream, warmup: int = 1, reps: int = 3) -> float:
    """Median ms of ``run()`` on ``stream``, timed with CUDA events."""
    import cupy as cp

    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)
