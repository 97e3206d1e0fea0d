"""The autotuner's policy without a GPU: buckets, cost lines per algorithm, and the plan of a call.

The tables here are built from made-up timings; the GPU tests (test_cudnn_gpu.py) check
that the plans the engine runs give the reference engine's numbers.
"""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.cudnn.autotune import (AlgoTable, BucketChoice, Group, ReplayLine, Trial, batch_buckets, choose,
                                            plan)

def test_batch_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(64, [8, 1, 256]) == (1, 8, 256)


def _table(fast_persistent: bool, buckets=(1, 2, 4, 8), forced=None) -> AlgoTable:
    per = []
    for b in buckets:
        std = Trial(0, time_ms=10.0 + b)
        pst = Trial(1, time_ms=(2.0 if fast_persistent else 50.0) * b)
        algo = 1 if fast_persistent and pst.time_ms < std.time_ms else 0
        per.append(BucketChoice(b, algo, min(std.time_ms, pst.time_ms), {0: std, 1: pst}))
    return AlgoTable(tuple(buckets), [per], steps=10, forced=forced)


def test_plan_uniform_batch_uses_its_bucket_choice():
    groups = plan(_table(True), 3, 10, np.full(3, 10))
    assert len(groups) == 1 and groups[0].rows is None and groups[0].algos == (1,)


def test_plan_ragged_without_persistent_is_one_standard_call():
    groups = plan(_table(False), 5, 10, np.array([10, 3, 1, 10, 7]))
    assert len(groups) == 1 and groups[0].rows is None and groups[0].algos == (0,) and not groups[0].uniform


def test_plan_ragged_splits_when_groups_are_cheaper():
    lengths = np.array([10, 10, 4, 10])
    groups = plan(_table(True), 4, 10, lengths)
    assert sorted((g.n, g.steps) for g in groups) == [(1, 4), (3, 10)]
    covered = np.zeros(4, int)
    for g in groups:
        covered[np.arange(4)[g.rows]] += 1
        assert np.all(lengths[np.arange(4)[g.rows]] == g.steps)
    assert np.all(covered == 1)


def test_plan_large_batch_is_cut_into_biggest_buckets():
    groups = plan(_table(True), 20, 10, np.full(20, 10))
    if len(groups) > 1:
        assert all(g.n <= 8 for g in groups) and sum(g.n for g in groups) == 20


@pytest.mark.parametrize("fast_persistent", [False, True])
@pytest.mark.parametrize("pad_ok", [False, True])
def test_plan_pruning_never_changes_the_choice(fast_persistent, pad_ok):
    """The lower bound that skips building groups only skips plans that would lose anyway."""
    rng = np.random.default_rng(5)
    pruned, exhaustive = _table(fast_persistent), _table(fast_persistent)
    exhaustive.__dict__["min_step_ms"] = -1e9  # a bound that never prunes
    for _ in range(300):
        b = int(rng.integers(1, 12))
        lengths = rng.integers(1, 11, size=b) if rng.random() < 0.5 else rng.choice([3, 10], size=b)
        want = plan(exhaustive, b, 10, lengths, pad_ok)
        got = plan(pruned, b, 10, lengths, pad_ok)
        assert [(g.n, g.steps, g.algos, g.uniform) for g in got] == [(g.n, g.steps, g.algos, g.uniform) for g in want]


def test_plan_forced_algorithm_always_splits_ragged_batches():
    groups = plan(_table(True, forced=1), 3, 10, np.array([10, 2, 10]))
    assert len(groups) == 2


def _flat_persistent_table(buckets=(1, 2, 4, 8)) -> AlgoTable:
    # persistent kernels cost the same at every batch size here (launch-bound), STANDARD grows
    per = []
    for b in buckets:
        std, pst = Trial(0, time_ms=10.0 + b), Trial(1, time_ms=3.0)
        per.append(BucketChoice(b, 1, 3.0, {0: std, 1: pst}))
    return AlgoTable(tuple(buckets), [per], steps=10)


def test_plan_pads_a_ragged_batch_only_when_allowed_and_cheaper():
    lengths = np.arange(10, 2, -1)  # 8 distinct lengths
    padded = plan(_flat_persistent_table(), 8, 10, lengths, pad_ok=True)
    assert len(padded) == 1 and padded[0].rows is None and padded[0].uniform and padded[0].algos == (1,)
    assert padded[0].steps == 10 and padded[0].n == 8
    not_allowed = plan(_flat_persistent_table(), 8, 10, lengths)
    assert not (len(not_allowed) == 1 and not_allowed[0].uniform)
    # where a bigger batch costs more, one long and many short sequences are cheaper as groups
    skewed = np.array([10, 1, 1, 1, 1, 1, 1, 1])
    groups = plan(_table(True), 8, 10, skewed, pad_ok=True)
    assert len(groups) == 2


# -- cost lines: two tuning lengths --------------------------------------------------------------------

def test_trial_cost_is_the_line_through_its_two_timings():
    t = Trial(1, time_ms=2.0, long_ms=5.0)  # 50 and 200 steps: 1 ms fixed + 0.02 ms a step
    assert t.cost_ms(100, 50, 200) == pytest.approx(3.0)
    assert t.cost_ms(10, 50, 200) == pytest.approx(1.2)
    assert Trial(1, time_ms=2.0).cost_ms(100, 50, 200) == pytest.approx(4.0)  # one length: proportional
    # noise that makes the longer run faster does not give a negative slope
    assert Trial(1, time_ms=2.0, long_ms=1.9).cost_ms(400, 50, 200) == pytest.approx(2.0)


def _gru_h1024_table() -> AlgoTable:
    """Shaped like the H200's fp16 GRU H=1024 L=2 at B=64: STANDARD has a large fixed part, the
    persistent kernel a steep slope, so the persistent kernel wins short calls and loses long ones."""
    per = []
    for b in (1, 8, 64):
        std = Trial(0, time_ms=2.6, long_ms=3.8)   # 2.2 ms + 0.008 ms/step
        pst = Trial(1, time_ms=1.75, long_ms=7.0)  # 0.0 ms + 0.035 ms/step
        per.append(choose(b, {0: std, 1: pst}))
    return AlgoTable((1, 8, 64), [per], steps=50, long_steps=200)


def test_algorithm_is_chosen_at_the_calls_own_length():
    table = _gru_h1024_table()
    assert table.choices[0][2].algo == 1  # what one tuning length alone would have kept
    assert table.algos_for(64, 50) == (1,)
    assert table.algos_for(64, 10) == (1,)
    assert table.algos_for(64, 100) == (0,)
    assert table.algos_for(64, 200) == (0,)
    assert table.algos_for(64) == (1,)  # default: the first tuning length
    (g,) = plan(table, 64, 100, np.full(64, 100))
    assert g.algos == (0,)
    (g,) = plan(table, 64, 20, np.full(64, 20))
    assert g.algos == (1,)


def test_describe_reports_the_choice_at_both_lengths():
    (block,) = _gru_h1024_table().describe()
    assert block["steps"] == 50 and block["long_steps"] == 200
    row = block["buckets"][2]
    assert row["algo"] == "persist_static" and row["algo_long"] == "standard" and row["long_ms"] == 3.8
    assert {t["algo"]: t.get("long_ms") for t in row["tried"]} == {"standard": 3.8, "persist_static": 7.0}
    assert row["long_host_ms"] is None  # no host lines in this table
    (block,) = _standard_only_table(1.3, graphs=True).describe()[:1]
    assert block["buckets"][0]["long_host_ms"] == 5.2 and block["buckets"][0]["tried"][0]["host_ms"] == 1.3


def test_margin_applies_at_the_calls_length():
    # 4 % faster than STANDARD at 200 steps is inside the 5 % margin: STANDARD stays
    std, pst = Trial(0, time_ms=1.0, long_ms=4.0), Trial(1, time_ms=0.5, long_ms=3.85)
    table = AlgoTable((8,), [[choose(8, {0: std, 1: pst})]], steps=50, long_steps=200)
    assert table.algos_for(8, 50) == (1,)
    assert table.algos_for(8, 200) == (0,)


def _random_lines_table(seed: int, buckets=(1, 2, 4, 8)) -> AlgoTable:
    rng = np.random.default_rng(seed)
    per = []
    for b in buckets:
        trials = {}
        for algo in (0, 1, 3):
            short = float(rng.uniform(0.2, 3.0)) * (1 + b / 4)
            trials[algo] = Trial(algo, time_ms=short, long_ms=short * float(rng.uniform(0.8, 6.0)))
        per.append(choose(b, trials))
    return AlgoTable(tuple(buckets), [per, per], steps=10, long_steps=40)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("pad_ok", [False, True])
def test_plan_pruning_with_cost_lines_never_changes_the_choice(seed, pad_ok):
    _check_pruning(lambda: _random_lines_table(seed), np.random.default_rng(seed + 100), 12, 40, pad_ok)


def _check_pruning(make_table, rng, max_batch: int, longest: int, pad_ok: bool) -> None:
    """Random ragged calls plan the same on a table whose lower bound never prunes."""
    pruned, exhaustive = make_table(), make_table()
    exhaustive.__dict__["_bounds"] = (0.0, -1e9)  # a bound nothing is ever above
    assert exhaustive.min_step_ms == -1e9
    for _ in range(300):
        b = int(rng.integers(1, max_batch))
        lengths = rng.integers(1, longest + 1, size=b) if rng.random() < 0.5 else rng.choice([3, longest], size=b)
        steps = int(lengths.max())
        want = plan(exhaustive, b, steps, lengths, pad_ok)
        got = plan(pruned, b, steps, lengths, pad_ok)
        assert [(g.n, g.steps, g.algos, g.uniform) for g in got] == [(g.n, g.steps, g.algos, g.uniform) for g in want]


def test_group_runs_its_own_length_with_that_lengths_algorithm():
    table = _gru_h1024_table()
    lengths = np.array([200] * 8 + [10] * 8)
    groups = plan(table, 16, 200, lengths)
    by_len = {g.steps: g for g in groups}
    if len(groups) > 1:
        assert isinstance(by_len[10], Group) and by_len[10].algos == (1,) and by_len[200].algos == (0,)


# -- host lines: graphs replay equal-length calls, ragged ones pay their launches ----------------------

def _standard_only_table(host_ms: float | None, graphs: bool, buckets=(1, 2, 4, 8, 16, 32)) -> AlgoTable:
    """Shaped like the H100's 2-layer LSTM H=256: every bucket chose STANDARD (timed as graph replays, ~1.5 ms
    at 200 steps), whose uncaptured launches take ``host_ms`` at 50 steps (x4 at 200)."""
    per = []
    for b in buckets:
        std = Trial(0, time_ms=0.4 + 0.005 * b, long_ms=1.5 + 0.01 * b,
                    host_ms=host_ms, long_host_ms=None if host_ms is None else 4 * host_ms)
        pst = Trial(1, time_ms=2.0 + b, long_ms=8.0 + 4 * b)  # persistent kernels lose at every bucket
        per.append(choose(b, {0: std, 1: pst}))
    return AlgoTable(tuple(buckets), [per, per], steps=50, long_steps=200, graphs=graphs)


def test_trial_launch_line_and_call_cost():
    t = Trial(0, time_ms=0.4, long_ms=1.5, host_ms=1.3, long_host_ms=5.2)
    assert t.launch_ms(200, 50, 200) == pytest.approx(5.2) and t.launch_ms(100, 50, 200) == pytest.approx(2.6)
    assert Trial(0, time_ms=0.4).launch_ms(200, 50, 200) == 0.0  # not measured
    table = _standard_only_table(1.3, graphs=True)
    gpu = 2 * (1.5 + 0.01 * 32)
    assert table.call_ms((0, 0), 20, 200, captured=True) == pytest.approx(gpu)
    assert table.call_ms((0, 0), 20, 200, captured=False) == pytest.approx(2 * 5.2)  # launch-bound
    assert table.launch_ms(0, 0, 500, 200) == pytest.approx(5.2)  # launches do not grow with rows
    # without graphs the times are of uncaptured calls already: no host line is added
    assert _standard_only_table(None, graphs=False).call_ms((0, 0), 20, 200, False) == pytest.approx(gpu)


def test_a_launch_bound_ragged_batch_runs_padded_so_that_it_replays_a_graph():
    lengths = np.random.default_rng(3).integers(20, 201, size=20)
    lengths[0] = 200
    (g,) = plan(_standard_only_table(1.3, graphs=True), 20, 200, lengths, pad_ok=True)
    assert g.rows is None and g.uniform and g.algos == (0, 0) and (g.n, g.steps) == (20, 200)
    # without graphs, or when the launches cost less than the GPU work, the ragged call stays one call
    for table in (_standard_only_table(None, graphs=False), _standard_only_table(0.05, graphs=True)):
        (g,) = plan(table, 20, 200, lengths, pad_ok=True)
        assert g.rows is None and not g.uniform
    # final states wanted (no padding): many distinct lengths are still cheapest as one ragged call
    (g,) = plan(_standard_only_table(1.3, graphs=True), 20, 200, lengths, pad_ok=False)
    assert g.rows is None and not g.uniform


def test_groups_are_costed_with_their_launches():
    """Equal-length groups run at exact lengths, which seldom repeat, so they are weighed as uncaptured calls:
    a launch-bound batch of two lengths stays one ragged call rather than two launch-bound groups."""
    table = _standard_only_table(1.3, graphs=True)
    lengths = np.array([200] * 10 + [40] * 10)
    (g,) = plan(table, 20, 200, lengths, pad_ok=False)
    assert g.rows is None and not g.uniform
    # where launches are cheap, the same two lengths split into groups as before (their GPU time is less)
    cheap = _standard_only_table(0.01, graphs=True)
    assert len(plan(cheap, 20, 200, lengths, pad_ok=False)) == 1  # standard only: one call's GPU time wins
    assert table.call_ms((0, 0), 10, 40, captured=False) == pytest.approx(2 * 1.3 * 40 / 50)


@pytest.mark.parametrize("pad_ok", [False, True])
def test_plan_pruning_with_host_lines_never_changes_the_choice(pad_ok):
    _check_pruning(lambda: _standard_only_table(1.3, True), np.random.default_rng(11), 40, 200, pad_ok)


# -- replay lines: the whole model replayed in its chosen IO layout ------------------------------------

def _h512_like_table(replayed: bool) -> AlgoTable:
    """Two blocks; single sequences run a persistent kernel (one launch a block), from 2 rows STANDARD, whose
    block lines (timed batch-major) read 1.6 / 6.2 ms a block at 32 rows; the whole model replayed in its
    served layout takes 2.0 / 7.2 ms (``replayed``: that replay line is recorded)."""
    per = []
    for b in (1, 2, 4, 8, 16, 32):
        std = Trial(0, time_ms=1.6 * (0.5 + b / 64), long_ms=6.2 * (0.5 + b / 64), host_ms=1.3, long_host_ms=5.2)
        pst = Trial(1, time_ms=0.1, long_ms=0.4, host_ms=0.02, long_host_ms=0.02) if b == 1 else \
            Trial(1, time_ms=30.0, long_ms=120.0)
        per.append(choose(b, {0: std, 1: pst}))
    table = AlgoTable((1, 2, 4, 8, 16, 32), [per, per], steps=50, long_steps=200, graphs=True)
    if replayed:
        table.set_replay_line(32, ReplayLine((0, 0), (0, 0), 2.0, 7.2))
    return table


def test_a_replay_line_is_the_gpu_time_of_the_calls_it_was_timed_with():
    table = _h512_like_table(replayed=True)
    assert table.gpu_ms((0, 0), 20, 200) == pytest.approx(7.2)
    assert table.gpu_ms((0, 0), 32, 100) == pytest.approx(2.0 + (7.2 - 2.0) * 50 / 150)
    assert table.gpu_ms((0, 0), 64, 200) == pytest.approx(14.4)  # past the biggest bucket: by rows
    blocks = table.cost_ms(0, 0, 20, 200) + table.cost_ms(1, 1, 20, 200)
    assert table.gpu_ms((0, 1), 20, 200) == pytest.approx(blocks)  # other algorithms: the blocks' lines
    assert table.gpu_ms((0, 0), 16, 200) == pytest.approx(2 * 6.2 * (0.5 + 16 / 64))  # no line at that bucket
    # a line whose two lengths ran different algorithms is not used for either
    table.set_replay_line(16, ReplayLine((0, 0), (1, 1), 1.0, 3.0))
    assert table.gpu_ms((0, 0), 16, 200) == pytest.approx(2 * 6.2 * (0.5 + 16 / 64))


def test_a_replay_line_below_the_blocks_lines_makes_a_ragged_batch_run_padded():
    """Where the whole model replayed in its served layout costs less than the sum of its blocks' lines, the padded
    call is weighed at that: here one padded replay instead of 20 single-sequence calls."""
    lengths = np.append(np.random.default_rng(5).choice(np.arange(20, 200), size=19, replace=False), 200)
    groups = plan(_h512_like_table(replayed=False), 20, 200, lengths, pad_ok=True)
    assert len(groups) == 20 and all(g.n == 1 and g.algos == (1, 1) for g in groups)
    (g,) = plan(_h512_like_table(replayed=True), 20, 200, lengths, pad_ok=True)
    assert g.rows is None and g.uniform and g.algos == (0, 0) and (g.n, g.steps) == (20, 200)


def test_replay_lines_lower_the_pruning_bound():
    table = _h512_like_table(replayed=False)
    before = (table.min_fixed_ms, table.min_step_ms)
    table.set_replay_line(32, ReplayLine((0, 0), (0, 0), 0.01, 0.03))  # cheaper than any block line
    assert table.min_step_ms < before[1] and table.min_fixed_ms <= before[0]
    assert table.min_step_ms == pytest.approx(0.02 / 150)


@pytest.mark.parametrize("pad_ok", [False, True])
def test_plan_pruning_with_replay_lines_never_changes_the_choice(pad_ok):
    def make():
        table = _h512_like_table(replayed=True)
        table.set_replay_line(8, ReplayLine((0, 0), (0, 0), 0.05, 0.2))
        return table
    _check_pruning(make, np.random.default_rng(12), 40, 200, pad_ok)


# -- chunks: the longest rows and the rest, each run padded ---------------------------------------------

def _rows_cost_table(ms_per_row: float) -> AlgoTable:
    """One block, STANDARD everywhere, replayed: at 200 steps a call costs 0.5 ms + ``ms_per_row`` a row (at
    its bucket), and a quarter of that at 50 steps; launches are expensive (ragged calls are launch-bound)."""
    per = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        std = Trial(0, time_ms=(0.5 + ms_per_row * b) / 4, long_ms=0.5 + ms_per_row * b, host_ms=1.3,
                    long_host_ms=5.2)
        per.append(choose(b, {0: std}))
    return AlgoTable((1, 2, 4, 8, 16, 32, 64), [per], steps=50, long_steps=200, graphs=True)


def test_a_ragged_batch_whose_rows_cost_runs_as_its_longest_rows_and_the_rest():
    lengths = np.append(np.random.default_rng(7).integers(20, 120, size=19), 200)
    (long, rest) = plan(_rows_cost_table(0.1), 20, 200, lengths, pad_ok=True)
    assert long.padded and rest.padded and long.uniform and rest.uniform
    assert sorted(np.concatenate([long.rows, rest.rows]).tolist()) == list(range(20))
    assert long.steps == 200 and rest.steps == int(lengths[rest.rows].max())
    assert lengths[long.rows].min() >= lengths[rest.rows].max()  # the longest rows run at the full length
    assert (long.n, rest.n) == (len(long.rows), len(rest.rows)) and long.n in (1, 2, 4, 8, 16)
    # a latency-bound model (rows cost nothing): one padded call
    (g,) = plan(_rows_cost_table(0.0), 20, 200, lengths, pad_ok=True)
    assert g.rows is None and not g.padded
    # final states wanted: no padding, so no chunks
    assert not any(g.padded for g in plan(_rows_cost_table(0.1), 20, 200, lengths, pad_ok=False))


def test_chunks_follow_the_h512_timings():
    """The H100's 2-layer H=512 LSTM, replayed (bench/results/h100-2026-11-30/): 16 rows at 200 steps take 2.7
    ms, 32 rows 6.1 ms; a ragged batch of 20 then runs its 16 longest rows and the other 4 apart."""
    per = []
    times = {1: (0.14, 0.49), 2: (0.22, 0.81), 4: (0.32, 1.19), 8: (0.54, 1.96), 16: (0.78, 2.73), 32: (1.6, 6.05),
             64: (1.39, 5.41)}
    for b, (short, long) in times.items():
        per.append(choose(b, {0: Trial(0, time_ms=short, long_ms=long, host_ms=1.5, long_host_ms=5.9)}))
    table = AlgoTable(tuple(times), [per], steps=50, long_steps=200, graphs=True)
    lengths = np.append(np.random.default_rng(8).integers(20, 201, size=19), 200)
    long, rest = plan(table, 20, 200, lengths, pad_ok=True)
    assert (long.n, rest.n) == (16, 4)
