"""bench/ragged_batches.py: its batches, and the planner it compares against (its GPU loop needs a device)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ragged_batches  # noqa: E402 - bench/ragged_batches.py

from service.engines.cudnn.autotune import AlgoTable, BucketChoice, ReplayLine, Trial, plan  # noqa: E402
from service.engines.cudnn.shape_buckets import GraphShapes  # noqa: E402


def test_batches_are_ragged_within_the_range_and_padded_to_their_longest():
    got = ragged_batches.batches(np.random.default_rng(0), 20, 5, 20, 200, 40)
    assert len(got) == 5
    for x, lengths in got:
        assert x.shape == (20, int(lengths.max()), 40) and x.dtype == np.float32
        assert lengths.min() >= 20 and lengths.max() <= 200 and len(set(lengths.tolist())) > 1


def test_without_host_lines_plans_as_the_round_before_last_did():
    per = [BucketChoice(b, 0, 0.4, {0: Trial(0, time_ms=0.4, long_ms=1.5, host_ms=1.3, long_host_ms=5.2)})
           for b in (1, 8, 32)]
    table = AlgoTable((1, 8, 32), [per, per], steps=50, long_steps=200, graphs=True)
    engine = SimpleNamespace(_table=table, _plans={(20, 200): "stale"}, _shapes=GraphShapes(table, True))
    lengths = np.random.default_rng(1).integers(20, 201, 20)
    lengths[0] = 200
    assert plan(table, 20, 200, lengths, True)[0].uniform  # launch-bound: padded, to replay a graph
    assert engine._shapes.padded(20, 197) == (32, 208)  # steps to the grid: a replay saves ~7 ms of launches
    ragged_batches.as_before(engine, "host-lines")
    assert all(t.host_ms is None and t.long_host_ms is None for c in per for t in c.trials.values())
    assert not plan(table, 20, 200, lengths, True)[0].uniform  # GPU times only: a tie, the ragged call
    assert engine._plans == {} and engine._shapes.padded(20, 197) == (32, 197)  # 0.1 ms buys no steps



def test_without_replay_lines_plans_by_the_blocks_lines_as_the_last_round_did():
    per = [BucketChoice(b, 0, 0.4, {0: Trial(0, time_ms=0.4, long_ms=1.5, host_ms=1.3, long_host_ms=5.2)})
           for b in (1, 8, 32)]
    table = AlgoTable((1, 8, 32), [per, per], steps=50, long_steps=200, graphs=True)
    table.set_replay_line(32, ReplayLine((0, 0), (0, 0), 0.5, 2.0))
    engine = SimpleNamespace(_table=table, _plans={(20, 200): "stale"}, _shapes=GraphShapes(table, True))
    assert table.gpu_ms((0, 0), 20, 200) == 2.0 and table.min_step_ms < 2 * 1.1 / 150
    ragged_batches.as_before(engine, "replay-lines")
    assert table.gpu_ms((0, 0), 20, 200) == 3.0 and table.min_step_ms == 2 * 1.1 / 150
    assert per[0].trials[0].host_ms == 1.3 and engine._plans == {}  # host lines kept
