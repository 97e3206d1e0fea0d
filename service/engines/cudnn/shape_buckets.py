"""Coarser shapes for padded calls, so that ragged traffic replays CUDA graphs instead of launching cuDNN.

A ragged many-to-one batch of a causal model runs padded (every row to the batch's
longest length; see :func:`.autotune.plan`), so its shape is (rows, longest length),
which under real traffic almost never repeats: 64 batch sizes times 200 lengths, and a
CUDA graph is captured only for a shape seen twice. Each such call then paid cuDNN's
host-side launch (about a tenth of the engine process's thread under binary-HTTP load
at concurrency 64, H100 host). Running the call at a slightly larger shape from a small
set lets a few dozen graphs cover the traffic:

* rows up to the batch-size bucket, when the autotuner's timings say the GPU time
  barely grows with rows there (small models are latency-bound: 64 rows cost about
  what 33 do); extra rows compute on whatever the graph's input buffer holds and
  are never read;
* steps up to a grid with 2, 4 or 8 values per octave (the coarsest whose extra steps
  fit the budget), past each row's length, where a causal model's outputs are not read.

Each side may add at most half a budget of estimated GPU time: what a replay saves on the
host, that is the uncaptured call's launches beyond its GPU time, from the autotuner's host
lines (:meth:`.autotune.AlgoTable.launch_ms`), and at least ``PAD_BUDGET_MS``. Small models
whose buckets run persistent kernels (one launch per layer) save little, so they pad little
and a model whose GPU time grows with every row and step keeps its exact shapes; a model
whose calls run cuDNN's STANDARD algorithm (per-step launches: ~5 ms of host time for 200
steps of a 2-layer H=256 LSTM, H100) saves much more, and pads to reach a graph. The coarser
step grids (2 and 4 values per octave) are taken only while their extra steps also cost at
most ``COARSE_FRACTION`` of the call's GPU time: a call that replays is GPU-bound, and
padding it further only slows it; the finest grid keeps the number of graphs bounded.
Equal-length calls that need their final states (stream chunks) pad rows only: steps past
a sequence's end would change its final state.
"""
from __future__ import annotations

from typing import Callable

from .autotune import AlgoTable

PAD_BUDGET_MS = 0.1      # the least budget: a replay's host saving measured on a small persistent-kernel model
COARSE_FRACTION = 0.1    # the 2 and 4 per octave grids may add at most this share of the call's GPU time


def round_steps(steps: int, per_octave: int) -> int:
    """``steps`` rounded up to a grid of ``per_octave`` values per power of two (exact below ``per_octave``)."""
    if steps <= per_octave:
        return steps
    stride = 1 << max(0, steps.bit_length() - 1 - per_octave.bit_length() + 1)
    return -(-steps // stride) * stride


def _cost(table: AlgoTable, n: int, steps: int) -> float:
    return table.gpu_ms(table.algos_for(min(n, table.biggest), steps), n, steps)


def pad_budget(table: AlgoTable, n: int, steps: int) -> float:
    """The ms a replay saves for a call of ``n`` rows and ``steps`` steps: its uncaptured launches beyond its
    GPU time (see :meth:`.autotune.AlgoTable.call_ms`), at least ``PAD_BUDGET_MS``."""
    algos = table.algos_for(min(n, table.biggest), steps)
    return max(PAD_BUDGET_MS, table.call_ms(algos, n, steps, captured=False) - _cost(table, n, steps))


def graph_rows(table: AlgoTable, n: int, steps: int, budget_ms: float | None = None) -> int:
    """Rows to run a call of ``n`` rows and ``steps`` steps at: ``n``'s batch bucket when the table's
    timings put the extra rows within ``budget_ms / 2`` (default: :func:`pad_budget`), else ``n``."""
    if n > table.biggest:
        return n
    bucket = table.bucket_for(n)
    if bucket == n:
        return n
    if budget_ms is None:
        budget_ms = pad_budget(table, n, steps)
    smaller = [b for b in table.buckets if b < bucket]
    prev = smaller[-1] if smaller else 0
    base = _cost(table, prev, steps) if prev else 0.0
    per_row = max(0.0, (_cost(table, bucket, steps) - base) / (bucket - prev))
    return bucket if per_row * (bucket - n) <= budget_ms / 2 else n


def graph_shape(table: AlgoTable, n: int, steps: int, budget_ms: float | None = None) -> tuple[int, int]:
    """(rows, steps) to run a padded call of ``n`` rows and ``steps`` steps at: each at least as large
    (``budget_ms``: default :func:`pad_budget`)."""
    if n > table.biggest:
        return n, steps
    if budget_ms is None:
        budget_ms = pad_budget(table, n, steps)
    rows = graph_rows(table, n, steps, budget_ms)
    base = _cost(table, rows, steps)
    coarse = max(PAD_BUDGET_MS / 2, COARSE_FRACTION * base)
    for per_octave in (2, 4, 8):
        candidate = round_steps(steps, per_octave)
        extra = _cost(table, rows, candidate) - base
        if extra <= budget_ms / 2 and (per_octave == 8 or extra <= coarse):
            return rows, candidate
    return rows, steps


class GraphShapes:
    """One engine's shapes to replay graphs at, per call shape, computed once (see :func:`graph_rows`,
    :func:`graph_shape`); every call keeps its own shape when ``enabled`` is False."""

    LIMIT = 65536  # (rows, steps) pairs remembered; forgotten all at once past it

    def __init__(self, table: AlgoTable | None, enabled: bool) -> None:
        self.table = table
        self.enabled = enabled
        self._rows: dict[tuple[int, int], tuple[int, int]] = {}
        self._padded: dict[tuple[int, int], tuple[int, int]] = {}

    def rows(self, n: int, steps: int) -> tuple[int, int]:
        """The shape of an equal-length call whose final states are read: more rows at most."""
        return self._shape(self._rows, n, steps, lambda: (graph_rows(self.table, n, steps), steps))

    def padded(self, n: int, steps: int) -> tuple[int, int]:
        """The shape of a padded call (no final states read): more rows and steps at most."""
        return self._shape(self._padded, n, steps, lambda: graph_shape(self.table, n, steps))

    def _shape(self, cache: dict, n: int, steps: int, compute: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        if not self.enabled:
            return n, steps
        shape = cache.get((n, steps))
        if shape is None:
            if len(cache) >= self.LIMIT:
                cache.clear()
            shape = cache[(n, steps)] = compute()
        return shape
