"""Choosing a cuDNN RNN algorithm per batch-size bucket, and planning each call.

At load the engine times every algorithm cuDNN accepts for each block and each
batch bucket (1, 2, 4, ... up to max_batch_size) at two sequence lengths, ``steps``
(default 50) and ``4 * steps``, on random data. From the two times each algorithm
gets a cost line, fixed ms + ms per step, and every call uses the algorithm whose
line is lowest at the call's own length. One length is not enough: STANDARD has a
large fixed part (it pipelines the input GEMMs and the layers), persistent kernels a
small fixed part and a steeper slope at large batches, so a persistent kernel that
won at 50 steps lost at 100 (H200: fp16 GRU H=1024 L=2 B=64, 1.75 vs 2.61 ms at 50
steps, 3.40 vs 2.99 ms at 100). An algorithm is used only if it also reproduces
STANDARD's output (a silently wrong kernel is worse than a slow one), and a
persistent algorithm must beat STANDARD by 5% at that length to be chosen, since it
comes with constraints (below). PERSIST_DYNAMIC is compiled for one exact batch
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

by estimating each from the cost lines (groups pay a fixed gather/scatter cost each). With typical ragged
traffic (many distinct lengths) the whole-batch STANDARD call wins; equal-length
groups win when a few lengths repeat, e.g. a streaming client's fixed chunks.

Where the engine replays CUDA graphs, the GPU times above are of graph replays, and each
trial also has a host line: the ms its launches hold the calling thread when it runs
uncaptured (``host_ms``, ``long_host_ms``). A ragged call is never captured (cuDNN reads
its lengths from the host at launch), so the whole-batch STANDARD option costs the larger
of its GPU time and its launches, and so do groups (exact lengths rarely repeat, so their
shapes are seldom captured), while the padded option runs at a bucketed shape
(:mod:`.shape_buckets`) that replays a graph and costs its GPU time. Without that, a model
whose buckets all chose STANDARD (H=256, 2 layers: persistent kernels lose from 8 rows up)
tied padded with ragged, ran every ragged batch uncaptured, and spent 4.7-6.4 ms of host
time launching batches of 8-32 sequences whose GPU work, replayed, takes ~1.5 ms (H100,
bench/results/h100-2026-11-28/; with host lines 1.9-3.5 ms a batch, h100-2026-11-29/).

The per-block lines are timed block by block, batch-major, while a served call runs every block in its
bucket's IO layout (batch- or sequence-major, :func:`.tuning.tune_layouts`). Where graphs are on, that
layout tuning replays the whole model in both layouts at both lengths, and the chosen layout's times are
the bucket's replay line (:class:`ReplayLine`), which :meth:`AlgoTable.gpu_ms` uses for a call with the
same algorithms. (For the bench LSTMs the two layouts replay within 3 % of each other, and a multi-layer
LSTM is one block, so the replay line and the block line agree there; they part for models of several
blocks, and where one layout is slower.)

Where a call's GPU time grows with its rows, a ragged batch that runs padded may instead run as two
chunks, its longest rows at the full length and the rest at their own longest (:func:`_two_chunks`).
"""
from __future__ import annotations

import statistics
import time
from functools import cached_property
from dataclasses import dataclass, field

import numpy as np

from . import library as L

PERSISTENT_MARGIN = 0.95      # a persistent algorithm must take < 95% of STANDARD's time
GROUP_OVERHEAD_MS = 0.03      # gather + scatter + launches per equal-length group (estimate)
MAX_GROUPS = 32
# A call split in two chunks runs off the fused path: its upload, gathers, scatters and a second replay's copies
# held the host 0.3-0.5 ms longer than one fused padded call (H100, bench/ragged_batches.py launch host ms).
CHUNK_OVERHEAD_MS = 0.4
LONG_FACTOR = 4               # the second tuning length is this many times the first


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
    """One algorithm at one bucket: its median times at the two tuning lengths, or why it was not usable.

    ``time_ms`` is at the table's ``steps``, ``long_ms`` (when timed) at ``long_steps``.
    """

    algo: int
    time_ms: float | None = None
    error: str | None = None
    build_ms: float | None = None
    long_ms: float | None = None
    host_ms: float | None = None        # host ms of an uncaptured call at the short length (None: not measured)
    long_host_ms: float | None = None   # ... and at the long length

    @property
    def usable(self) -> bool:
        return self.time_ms is not None and not self.error

    def cost_ms(self, steps: int, short: int, long: int) -> float:
        """Estimated ms for ``steps`` steps from the timings at ``short`` and ``long`` steps.

        The line through both timings; where that line would cross zero before ``short`` steps,
        the line through the origin and the first timing below ``short``; a flat cost when noise
        made the longer run faster. Proportional to the steps when only one length was timed.
        """
        return _line_ms(self.time_ms, self.long_ms, steps, short, long)

    def launch_ms(self, steps: int, short: int, long: int) -> float:
        """Estimated host ms of an uncaptured call of ``steps`` steps (0.0 when not measured), by the same
        kind of line as :meth:`cost_ms`."""
        if self.host_ms is None:
            return 0.0
        return _line_ms(self.host_ms, self.long_host_ms, steps, short, long)

    def line(self, short: int, long: int) -> tuple[float, float]:
        """(fixed ms, ms per step) of a line that never exceeds :meth:`cost_ms` at any length >= 0."""
        return _lower_line(self.time_ms, self.long_ms, short, long)

    def to_dict(self) -> dict:
        d = {"algo": L.ALGO_NAMES[self.algo]}
        if self.time_ms is not None:
            d["time_ms"] = round(self.time_ms, 4)
        if self.long_ms is not None:
            d["long_ms"] = round(self.long_ms, 4)
        if self.host_ms is not None:
            d["host_ms"] = round(self.host_ms, 4)
        if self.long_host_ms is not None:
            d["long_host_ms"] = round(self.long_host_ms, 4)
        if self.build_ms is not None:
            d["build_ms"] = round(self.build_ms, 1)
        if self.error:
            d["error"] = self.error
        return d


def _lower_line(short_ms: float, long_ms: float | None, short: int, long: int) -> tuple[float, float]:
    """(fixed ms, ms per step) of a line never above :func:`_line_ms` of the same timings at any length >= 0."""
    if long_ms is None or long <= short:
        return 0.0, short_ms / short
    slope = (long_ms - short_ms) / (long - short)
    if slope <= 0.0:
        return short_ms, 0.0
    fixed = short_ms - slope * short
    return (0.0, short_ms / short) if fixed < 0.0 else (fixed, slope)


def _line_ms(short_ms: float, long_ms: float | None, steps: int, short: int, long: int) -> float:
    if long_ms is None or long <= short:
        return short_ms * steps / short
    slope = (long_ms - short_ms) / (long - short)
    if slope <= 0.0:
        return short_ms
    fixed = short_ms - slope * short
    if fixed < 0.0 and steps < short:
        return short_ms * steps / short
    return fixed + slope * steps


@dataclass
class BucketChoice:
    """The algorithm kept for one (block, bucket) at the first tuning length, with every trial.

    ``algo_at`` gives the choice at any other length (see the module docstring).
    """

    bucket: int
    algo: int
    time_ms: float | None
    trials: dict[int, Trial] = field(default_factory=dict)
    forced: int | None = None

    def algo_at(self, steps: int, short: int, long: int) -> int:
        """The usable algorithm with the lowest estimated cost at ``steps`` (persistent ones by the margin)."""
        ok = {a: t for a, t in self.trials.items() if t.usable}
        if self.forced is not None and self.forced in ok:
            return self.forced
        std = ok.get(L.ALGO_STANDARD)
        if std is None:
            return self.algo
        best, best_cost = L.ALGO_STANDARD, std.cost_ms(steps, short, long)
        limit = PERSISTENT_MARGIN * best_cost
        for algo, trial in ok.items():
            if algo == L.ALGO_STANDARD:
                continue
            cost = trial.cost_ms(steps, short, long)
            if cost < limit and cost < best_cost:
                best, best_cost = algo, cost
        return best

    def to_dict(self, short: int | None = None, long: int | None = None) -> dict:
        d = {"bucket": self.bucket, "algo": L.ALGO_NAMES[self.algo],
             "time_ms": None if self.time_ms is None else round(self.time_ms, 4)}
        if short is not None and long is not None:
            at_long = self.algo_at(long, short, long)
            d["algo_long"] = L.ALGO_NAMES[at_long]
            trial = self.trials.get(at_long)
            d["long_ms"] = None if trial is None or trial.long_ms is None else round(trial.long_ms, 4)
            d["long_host_ms"] = (None if trial is None or trial.long_host_ms is None
                                 else round(trial.long_host_ms, 4))
        d["tried"] = [t.to_dict() for t in self.trials.values()]
        return d


def choose(bucket: int, trials: dict[int, Trial], forced: int | None = None) -> BucketChoice:
    """Keep the fastest usable trial at the first tuning length; persistent ones must beat STANDARD by the margin."""
    ok = {a: t for a, t in trials.items() if t.usable}
    std = ok.get(L.ALGO_STANDARD)
    if forced is not None and forced in ok:
        return BucketChoice(bucket, forced, ok[forced].time_ms, trials, forced)
    if std is None:
        return BucketChoice(bucket, L.ALGO_STANDARD, None, trials, forced)
    best = std
    for algo, trial in ok.items():
        if algo != L.ALGO_STANDARD and trial.time_ms < PERSISTENT_MARGIN * std.time_ms and trial.time_ms < best.time_ms:
            best = trial
    return BucketChoice(bucket, best.algo, best.time_ms, trials, forced)


@dataclass(frozen=True)
class ReplayLine:
    """One bucket's whole-model GPU ms as a graph replay in its chosen layout, at the two tuning lengths,
    with the algorithms that ran at each (see :func:`.tuning.tune_layouts`)."""

    algos: tuple[int, ...]
    long_algos: tuple[int, ...]
    time_ms: float
    long_ms: float


@dataclass(frozen=True)
class Group:
    """Part of a call run as one cuDNN call per block: ``rows`` (None = whole batch, a slice or an index array).

    ``padded``: rows of different lengths run to ``steps`` (a chunk, see :func:`plan`): outputs past each row's
    length and the final states are not valid.
    """

    rows: object
    n: int
    steps: int
    algos: tuple[int, ...]
    uniform: bool
    seq_major: bool = False
    padded: bool = False


class AlgoTable:
    """Per block, per bucket: the trials and their cost lines (ms at ``steps`` and ``long_steps``)."""

    def __init__(self, buckets: tuple[int, ...], choices: list[list[BucketChoice]], steps: int,
                 forced: int | None = None, long_steps: int | None = None, graphs: bool = False) -> None:
        self.graphs = graphs  # the engine replays CUDA graphs of equal-length calls (the times are of replays)
        self.buckets = buckets
        self.choices = choices
        self.steps = max(1, int(steps))
        self.long_steps = int(long_steps) if long_steps else self.steps
        self.forced = forced
        self.biggest = buckets[-1]
        self.any_persistent = any(t.usable and a != L.ALGO_STANDARD
                                  for per in choices for c in per for a, t in c.trials.items())
        self._by_bucket = [{c.bucket: c for c in per} for per in choices]
        self._algos: dict[tuple[int, int], tuple[int, ...]] = {}
        # bucket -> (seq_major chosen, {"batch_major": ms, "seq_major": ms}); batch-major when untimed
        self.layouts: dict[int, tuple[bool, dict[str, float | str]]] = {}
        self.chunks = True  # padded calls may split in two (see _two_chunks; benches compare without)
        # bucket -> the whole model replayed in the chosen layout, where timed so (graphs on; see set_replay_line)
        self.replay_lines: dict[int, ReplayLine] = {}

    def set_replay_line(self, bucket: int, line: ReplayLine) -> None:
        """Record ``bucket``'s replay line (see :meth:`gpu_ms`)."""
        self.replay_lines[bucket] = line
        self.__dict__.pop("_bounds", None)  # the bounds take replay lines in too

    def seq_major_for(self, n: int) -> bool:
        """Whether calls of ``n`` equal-length sequences run in cuDNN's sequence-major layout."""
        hit = self.layouts.get(self.bucket_for(n))
        return bool(hit and hit[0])

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.biggest

    def algos_for(self, n: int, steps: int | None = None) -> tuple[int, ...]:
        """Algorithms for an equal-length batch of ``n`` (n <= biggest bucket) and ``steps`` steps
        (default: the first tuning length)."""
        steps = self.steps if steps is None else int(steps)
        key = (n, steps)
        hit = self._algos.get(key)
        if hit is not None:
            return hit
        bucket = self.bucket_for(n)
        out = []
        for per in self._by_bucket:
            choice = per[bucket]
            algo = choice.algo_at(steps, self.steps, self.long_steps)
            if algo == L.ALGO_PERSIST_DYNAMIC and n != bucket and self.forced != algo:
                others = {a: t for a, t in choice.trials.items() if a != L.ALGO_PERSIST_DYNAMIC and t.usable}
                algo = (min(others, key=lambda a: others[a].cost_ms(steps, self.steps, self.long_steps))
                        if others else L.ALGO_STANDARD)
            out.append(algo)
        hit = tuple(out)
        if len(self._algos) > 4096:
            self._algos.clear()
        self._algos[key] = hit
        return hit

    @cached_property
    def _bounds(self) -> tuple[float, float]:
        """Lower bounds of any call's fixed ms and ms per step: per block, the least of any bucket and
        algorithm (a bigger batch than the biggest bucket only costs more)."""
        fixed = per_step = 0.0
        for per in self.choices:
            lines = [t.line(self.steps, self.long_steps) for c in per for t in c.trials.values() if t.usable]
            if not lines:
                continue
            fixed += min(f for f, _ in lines)
            per_step += min(s for _, s in lines)
        for r in self.replay_lines.values():  # a whole-model line may undercut the sum of the blocks' least
            f, step = _lower_line(r.time_ms, r.long_ms, self.steps, self.long_steps)
            fixed, per_step = min(fixed, f), min(per_step, step)
        return fixed, per_step

    @property
    def min_step_ms(self) -> float:
        """A lower bound of any call's ms per step (see ``_bounds``)."""
        return self._bounds[1]

    @property
    def min_fixed_ms(self) -> float:
        """A lower bound of any call's fixed ms (see ``_bounds``)."""
        return self._bounds[0]

    def cost_ms(self, block: int, algo: int, n: int, steps: int) -> float:
        """Estimated ms of ``algo`` on ``n`` sequences of ``steps`` steps (linear beyond the biggest bucket)."""
        choice = self._by_bucket[block][self.bucket_for(n)]
        trial = choice.trials.get(algo)
        if trial is not None and trial.usable:
            ms = trial.cost_ms(steps, self.steps, self.long_steps)
        else:
            ms = (choice.time_ms if choice.time_ms is not None else 1.0) * steps / self.steps
        if n > self.biggest:
            ms *= n / self.biggest
        return ms

    def launch_ms(self, block: int, algo: int, n: int, steps: int) -> float:
        """Estimated host ms of an uncaptured ``algo`` call of ``n`` sequences of ``steps`` steps (0.0 where not
        measured). Launches do not grow with the rows, so beyond the biggest bucket it is the biggest's."""
        trial = self._by_bucket[block][self.bucket_for(n)].trials.get(algo)
        if trial is None or not trial.usable:
            return 0.0
        return trial.launch_ms(steps, self.steps, self.long_steps)

    def gpu_ms(self, algos: tuple[int, ...], n: int, steps: int) -> float:
        """Estimated GPU ms of one call running ``algos`` (one per block) on ``n`` sequences of ``steps`` steps.

        The bucket's replay line where it was timed with these algorithms at both lengths: the whole model in
        the layout it is served in. Else the sum of the blocks' lines (timed batch-major, block by block).
        """
        line = self.replay_lines.get(self.bucket_for(n))
        if line is not None and algos == line.algos == line.long_algos:
            ms = _line_ms(line.time_ms, line.long_ms, steps, self.steps, self.long_steps)
            return ms * n / self.biggest if n > self.biggest else ms
        return sum(self.cost_ms(k, a, n, steps) for k, a in enumerate(algos))

    def call_ms(self, algos: tuple[int, ...], n: int, steps: int, captured: bool) -> float:
        """Estimated ms of one call running ``algos`` (one per block): its GPU time, and where it runs
        uncaptured (not ``captured``, or no graphs), at least its host launches (the thread is busy that long)."""
        gpu = self.gpu_ms(algos, n, steps)
        if captured and self.graphs:
            return gpu
        return max(gpu, sum(self.launch_ms(k, a, n, steps) for k, a in enumerate(algos)))

    def describe(self) -> list[dict]:
        return [{"block": k, "steps": self.steps, "long_steps": self.long_steps,
                 "buckets": [c.to_dict(self.steps, self.long_steps) for c in per]}
                for k, per in enumerate(self.choices)]

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
        return [Group(None, batch, steps, table.algos_for(batch, steps), True, table.seq_major_for(batch))]
    whole = [Group(None, batch, steps, standard, full, table.seq_major_for(batch))]
    if not table.any_persistent and not table.graphs:
        return whole
    longest = int(lengths.max())
    # ragged lengths are read from the host at launch, so only an equal-length call replays a graph
    whole_cost = table.call_ms(standard, batch, longest, captured=full)
    options: list[tuple[float, list[Group]]] = [(whole_cost, whole)]
    if pad_ok and batch <= table.biggest and table.forced is None:
        algos = table.algos_for(batch, steps)
        padded_cost = table.call_ms(algos, batch, steps, captured=True)
        options.append((padded_cost, [Group(None, batch, steps, algos, True, table.seq_major_for(batch))]))
        chunks = _two_chunks(table, batch, steps, lengths, min(cost for cost, _ in options)) \
            if table.chunks else None
        if chunks is not None:
            options.append(chunks)
    if table.forced is None:
        # At least one group per distinct length, none cheaper than the cheapest line of any bucket: when
        # even that bound loses, building the groups (Python work per group on every ragged call) is skipped.
        # (A set of a few dozen ints, not np.unique: this runs for every ragged batch.)
        distinct = set(lengths.tolist())
        bound = (table.min_step_ms * float(sum(distinct))
                 + (table.min_fixed_ms + GROUP_OVERHEAD_MS) * len(distinct))
        if len(distinct) > MAX_GROUPS or bound >= min(cost for cost, _ in options):
            return min(options, key=lambda o: o[0])[1]
    values, inverse = np.unique(lengths, return_inverse=True)
    groups: list[Group] = []
    cost = 0.0
    for i, length in enumerate(values):
        idx = np.flatnonzero(inverse == i)
        length = int(length)
        for start in range(0, idx.size, table.biggest):
            rows = idx[start:start + table.biggest]
            n = int(rows.size)
            if rows[-1] - rows[0] + 1 == n:
                rows = slice(int(rows[0]), int(rows[-1]) + 1)
            algos = table.algos_for(n, length)
            groups.append(Group(rows, n, length, algos, True, table.seq_major_for(n)))
            # exact lengths rarely repeat (lengths 20..200 give hundreds of shapes), so a group is costed
            # uncaptured: launches included
            cost += table.call_ms(algos, n, length, captured=False) + GROUP_OVERHEAD_MS
        if len(groups) > MAX_GROUPS and table.forced is None:
            break
    if table.forced is not None:
        return groups
    if len(groups) <= MAX_GROUPS:
        options.append((cost, groups))
    return min(options, key=lambda o: o[0])[1]


def _two_chunks(table: AlgoTable, batch: int, steps: int, lengths: np.ndarray,
                best: float) -> tuple[float, list[Group]] | None:
    """The cheapest split of a padded call into its ``k`` longest rows and the rest, each run padded to its own
    longest row (``k`` a bucket), when that costs less than ``best``; None otherwise.

    Where a call's GPU time grows with its rows (cuDNN's STANDARD algorithm at larger hidden sizes), the
    longest rows run at the full length and the rest at a shorter one, each at a bucketed shape that
    replays a graph: one long sequence no longer makes every row of the batch run its length. A 2-layer
    H=512 LSTM replays 16 rows of 200 steps in 2.7 ms and 32 in 6.1 ms (H100), so a ragged batch of 20
    runs as 16 + 4 rows in about half the time of one padded call.
    """
    first = table.buckets[0]
    if batch <= first:
        return None
    # skipped when the longest row alone at the full length costs too much (a bound where, as usual, a bucket
    # costs no less than the one below it): a latency-bound model never splits, at one estimate per batch
    if table.call_ms(table.algos_for(first, steps), first, steps, captured=True) + CHUNK_OVERHEAD_MS >= best:
        return None
    order = np.argsort(-lengths, kind="stable")
    found = None
    for k in table.buckets:
        if k >= batch:
            break
        rest, t_rest = batch - k, int(lengths[order[k]])
        a_long, a_rest = table.algos_for(k, steps), table.algos_for(rest, t_rest)
        cost = (table.call_ms(a_long, k, steps, captured=True) + table.call_ms(a_rest, rest, t_rest, captured=True)
                + CHUNK_OVERHEAD_MS)
        if cost < best:
            best, found = cost, (k, rest, t_rest, a_long, a_rest)
    if found is None:
        return None
    k, rest, t_rest, a_long, a_rest = found
    return best, [Group(order[:k], k, steps, a_long, True, table.seq_major_for(k), padded=True),
                  Group(order[k:], rest, t_rest, a_rest, True, table.seq_major_for(rest), padded=True)]


def time_call(run, stream, warmup: int = 1, reps: int = 5, graph: bool = False) -> float:
    """Median ms of ``run()`` on ``stream``, timed with CUDA events.

    ``graph``: time a CUDA graph of ``run()`` (what the engine replays once a shape repeats; see
    graphs.py): per-step launches then cost nothing, which changes which algorithm wins for
    STANDARD's many small kernels. A call that cannot be captured is timed as it is.
    """
    import cupy as cp

    for _ in range(warmup):
        run()
    call = run
    if graph:
        from .graphs import capture, capture_errors

        try:
            captured = capture(cp, stream, run)
            call = lambda: captured.launch(stream)  # noqa: E731
            call()
        except capture_errors(cp):
            call = run
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        call()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def host_call_ms(run, stream, reps: int = 3) -> float:
    """Median host ms of ``run()`` uncaptured, each started on an idle stream: how long its launches hold the
    calling thread (cuDNN's STANDARD algorithm launches kernels per step and layer)."""
    times = []
    for _ in range(reps):
        stream.synchronize()
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000.0)
    stream.synchronize()
    return statistics.median(times)
