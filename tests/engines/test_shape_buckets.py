"""Bucketed shapes of padded calls (service.engines.cudnn.shape_buckets) from made-up autotuner timings."""
from __future__ import annotations

import pytest

from service.engines.cudnn.autotune import AlgoTable, BucketChoice, Trial
from service.engines.cudnn.shape_buckets import graph_shape, round_steps


def test_round_steps_keeps_per_octave_values_and_never_shrinks():
    assert [round_steps(t, 8) for t in (5, 8, 9, 17, 20, 21, 129, 150, 200)] == [5, 8, 9, 18, 20, 22, 144, 160, 208]
    assert [round_steps(t, 4) for t in (20, 21, 129, 150, 200)] == [20, 24, 160, 160, 224]
    assert [round_steps(t, 2) for t in (20, 129, 200)] == [24, 192, 256]
    for per_octave in (2, 4, 8):
        grid = {round_steps(t, per_octave) for t in range(64, 128)}
        assert len(grid - {128}) == per_octave and max(grid) == 128
        assert all(round_steps(t, per_octave) >= t for t in range(1, 600))


def _table(ms_per_step: float, ms_per_row: float, buckets=(1, 2, 4, 8, 16, 32, 64)) -> AlgoTable:
    """One block, persistent everywhere; a call costs fixed + per step x (1 + rows x per-row share)."""
    per = []
    for b in buckets:
        at = lambda steps: 0.02 + ms_per_step * steps * (1 + ms_per_row * b)  # noqa: E731
        trial = Trial(1, time_ms=at(50), long_ms=at(200))
        per.append(BucketChoice(b, 1, trial.time_ms, {1: trial, 0: Trial(0, time_ms=10 * trial.time_ms)}))
    return AlgoTable(tuple(buckets), [per], steps=50, long_steps=200)


def test_a_latency_bound_model_pads_rows_to_the_bucket_and_steps_to_a_grid():
    table = _table(ms_per_step=0.003, ms_per_row=0.001)
    rows, steps = graph_shape(table, 19, 150)
    assert rows == 32 and steps in (160, 192) and steps >= 150
    assert graph_shape(table, 64, 128) == (64, 128)  # already on the grid and a bucket
    assert graph_shape(table, 100, 150) == (100, 150)  # past the biggest bucket: as it is


@pytest.mark.parametrize("n,t", [(19, 150), (3, 37), (33, 201)])
def test_a_model_whose_time_grows_with_rows_and_steps_keeps_its_shape(n, t):
    assert graph_shape(_table(ms_per_step=0.05, ms_per_row=0.5), n, t) == (n, t)


def test_the_estimated_extra_time_stays_within_the_budget():
    table = _table(ms_per_step=0.003, ms_per_row=0.02)
    for n in range(1, 65):
        for t in range(1, 260, 7):
            rows, steps = graph_shape(table, n, t, budget_ms=0.1)
            assert rows >= n and steps >= t

            def cost(r, s):
                return sum(table.cost_ms(k, a, r, s) for k, a in enumerate(table.algos_for(r, s)))

            assert cost(rows, t) - cost(n, t) <= 0.05 + 1e-9 or rows == n
            assert cost(rows, steps) - cost(rows, t) <= 0.05 + 1e-9


def test_graph_shapes_remember_each_shape_and_keep_them_exact_when_off():
    from service.engines.cudnn.shape_buckets import GraphShapes

    table = _table(ms_per_step=0.003, ms_per_row=0.001)
    on, off = GraphShapes(table, True), GraphShapes(table, False)
    assert on.padded(19, 150) == graph_shape(table, 19, 150) and on.padded(19, 150) is on.padded(19, 150)
    assert on.rows(19, 10) == (32, 10)  # final states read: the steps stay
    assert off.padded(19, 150) == (19, 150) and off.rows(19, 10) == (19, 10)
    assert GraphShapes(None, False).padded(3, 4) == (3, 4)  # an engine before tuning


def _launch_bound_table(host_ms_at_50: float | None) -> AlgoTable:
    """Two STANDARD blocks whose GPU time grows with rows and steps (H=256-like: ~0.8 ms per block at 20 rows
    of 200 steps) and whose uncaptured launches take ``host_ms_at_50`` per block at 50 steps (x4 at 200)."""
    per = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        at = lambda steps: 0.02 + 0.0035 * steps * (1 + 0.01 * b)  # noqa: E731
        trial = Trial(0, time_ms=at(50), long_ms=at(200), host_ms=host_ms_at_50,
                      long_host_ms=None if host_ms_at_50 is None else 4 * host_ms_at_50)
        per.append(BucketChoice(b, 0, trial.time_ms, {0: trial}))
    return AlgoTable((1, 2, 4, 8, 16, 32, 64), [per, per], steps=50, long_steps=200,
                     graphs=host_ms_at_50 is not None)


def test_a_launch_bound_model_pads_to_reach_a_graph_within_what_a_replay_saves():
    from service.engines.cudnn.shape_buckets import pad_budget

    exact = _launch_bound_table(None)
    assert pad_budget(exact, 20, 197) == pytest.approx(0.1)  # no host lines: the least budget
    assert graph_shape(exact, 20, 197) == (20, 197)  # 0.1 ms buys neither 12 rows nor 11 steps here
    bound = _launch_bound_table(1.3)
    budget = pad_budget(bound, 20, 197)
    assert budget == pytest.approx(2 * 1.3 * 197 / 50 - 2 * bound.cost_ms(0, 0, 20, 197), rel=1e-6)
    rows, steps = graph_shape(bound, 20, 197)
    assert rows == 32  # the bucket
    # the finest grid (208), not 224 or 256: those add more than COARSE_FRACTION of the GPU time, which a
    # replaying call is bound by
    assert steps == 208
    # a call whose launches cost less than its GPU work saves nothing by a replay: the least budget again
    assert pad_budget(_launch_bound_table(0.05), 20, 197) == pytest.approx(0.1)


def test_padding_is_weighed_by_replay_lines_where_the_table_has_them():
    """Bucketed shapes are what a replay costs: where the whole model replayed in its served layout barely grows
    with rows, rows pad to the bucket even if the blocks' own lines (timed batch-major) say otherwise."""
    from service.engines.cudnn.autotune import ReplayLine

    table = _table(ms_per_step=0.05, ms_per_row=0.5)
    assert graph_shape(table, 19, 150) == (19, 150)
    for b in table.buckets:
        table.set_replay_line(b, ReplayLine((1,), (1,), 0.2 + 0.001 * b, 0.8 + 0.001 * b))
    assert graph_shape(table, 19, 150) == (32, 160)
