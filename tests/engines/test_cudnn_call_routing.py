"""The cuDNN engine's host-side decisions that need no GPU: which calls become fused graphs
(service.engines.cudnn.fused.FusedCalls.try_launch) and how the algorithm table is built from timings
(service.engines.cudnn.tuning.tune_table). The GPU work they lead to is tested in the *_gpu.py files."""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.cudnn import library as L
from service.engines.cudnn import tuning
from service.engines.cudnn.autotune import Trial
from service.engines.cudnn.fused import FUSED_MAX_BYTES, FusedCalls
from service.errors import EngineUnavailable
from test_state_pool import model as pool_model


class _Table:
    biggest = 16

    def algos_for(self, n, t):
        return (L.ALGO_STANDARD,)

    def seq_major_for(self, b):
        return False


class _Shapes:
    def rows(self, b, t):
        return (8 if b <= 8 else 16), t

    def padded(self, b, t):
        return (8 if b <= 8 else 16), t + 3


def _routing(blocks=(("lstm", 6, 2),)):
    calls = []
    fused = FusedCalls(None, None, [], pool_model(list(blocks)).spec, np.float32, None, False)
    fused.launch = lambda *args, **kw: calls.append((args, kw)) or "launched"  # the GPU part, recorded

    def route(x, lens, h0=None, states_needed=True, last_only=False):
        checked = (x, x.shape[0], x.shape[1], np.asarray(lens), np.dtype(np.float32))
        return fused.try_launch(checked, h0, None, None, states_needed, last_only, _Table(), _Shapes(),
                                lambda n, t: ("uniform", n, t))

    return route, calls


def test_equal_length_calls_are_fused_at_their_bucket_rows():
    route, calls = _routing()
    x = np.zeros((3, 10, 5), np.float32)
    assert route(x, [10, 10, 10], h0=np.zeros((3, 2, 6), np.float32)) == "launched"
    args, kw = calls[-1]
    assert args[1:5] == (3, 10, (8, 10), ("uniform", 8, 10)) and "lengths" not in kw


def test_ragged_many_to_one_batches_are_fused_padded_with_their_lengths(monkeypatch):
    from service.engines.cudnn import fused as fused_module
    from service.engines.cudnn.autotune import Group

    route, calls = _routing()
    x = np.zeros((3, 10, 5), np.float32)
    padded = [Group(None, 3, 10, (L.ALGO_STANDARD,), True, False)]  # the planner runs the batch padded
    monkeypatch.setattr(fused_module, "plan", lambda table, b, t, lens, pad_ok: padded if pad_ok else None)
    assert route(x, [10, 4, 7], states_needed=False, last_only=True) == "launched"
    args, kw = calls[-1]
    assert args[3] == (8, 13) and args[4] == ("uniform", 8, 13)
    np.testing.assert_array_equal(kw["lengths"], [10, 4, 7])
    # the planner splits it by length instead: each group is its own call, on the general path
    grouped = [Group(slice(0, 1), 1, 10, (L.ALGO_STANDARD,), True, False),
               Group(np.array([1, 2]), 2, 7, (L.ALGO_STANDARD,), True, False)]
    monkeypatch.setattr(fused_module, "plan", lambda *a: grouped)
    assert route(x, [10, 4, 7], states_needed=False, last_only=True) is None and len(calls) == 1


@pytest.mark.parametrize("why", ["states wanted", "full output", "initial states", "bidirectional"])
def test_ragged_calls_that_need_exact_lengths_take_the_general_path(why):
    blocks = (("lstm", 6, 1),)
    route, calls = _routing(blocks)
    x = np.zeros((2, 6, 5), np.float32)
    if why == "bidirectional":  # not causal: padding would change the reverse direction
        from service.spec import BlockSpec, RNNSpec

        fused = FusedCalls(None, None, [], RNNSpec((BlockSpec("lstm", 5, 6, 1, True),)), np.float32, None, False)
        fused.launch = lambda *a, **k: calls.append(a)
        checked = (x, 2, 6, np.array([6, 3]), np.dtype(np.float32))
        assert fused.try_launch(checked, None, None, None, False, True, _Table(), _Shapes(), lambda n, t: None) is None
    else:
        kw = {"states wanted": dict(states_needed=True, last_only=True),
              "full output": dict(states_needed=False, last_only=False),
              "initial states": dict(states_needed=False, last_only=True, h0=np.zeros((2, 1, 6), np.float32))}[why]
        assert route(x, [6, 3], **kw) is None
    assert not calls


def test_large_inputs_and_device_arrays_take_the_general_path():
    route, calls = _routing()
    wide = FUSED_MAX_BYTES // (2 * 100 * 4) + 1  # features that put 2 x 100 steps over the limit
    assert route(np.zeros((2, 100, wide), np.float32), [100, 100]) is None
    assert route(np.zeros((17, 2, 5), np.float32), [2] * 17) is None  # more rows than the biggest bucket

    class DeviceArray:  # what a CuPy array is to the routing: not host memory
        shape = (2, 4, 5)

    assert route(DeviceArray(), [4, 4]) is None
    assert not calls


def _trials(times):
    """tune_block's answer for one block: per bucket, a Trial per algorithm (None: not usable)."""
    return [{a: Trial(a, time_ms=ms, error=None if ms is not None else "refused") for a, ms in per.items()}
            for per in times]


def test_tune_table_keeps_the_fastest_usable_algorithm_per_bucket(monkeypatch):
    std, pst = L.ALGO_STANDARD, L.ALGO_PERSIST_STATIC
    seen = []

    def fake_tune_block(runner, conv, buckets, steps, algos, tol, give_up, long_steps, graph):
        seen.append((algos, tol, give_up, long_steps, graph))
        return _trials([{std: 1.0, pst: 0.2}, {std: 1.0, pst: None}])

    monkeypatch.setattr(tuning, "tune_block", fake_tune_block)
    table = tuning.tune_table(["block"], None, (1, 2), 50, None, True, tuning.tolerance("float32", False), True)
    assert table.algos_for(1, 50) == (pst,) and table.algos_for(2, 50) == (std,)
    assert table.long_steps == 50 * tuning.LONG_FACTOR  # the second point of each cost line
    assert seen[0][0][0] == std and len(seen[0][0]) == 4 and seen[0][1:] == (1e-3, True, 50 * tuning.LONG_FACTOR, True)
    plain = tuning.tune_table(["block"], None, (1, 2), 50, None, False, 1e-3)
    assert plain.algos_for(1, 50) == (std,) and len(seen) == 1  # no timing without autotune


def test_tune_table_refuses_a_forced_algorithm_that_runs_nowhere(monkeypatch):
    class Runner:
        index = 0

        class spec:
            cell, hidden_size, proj_size = "lstm", 8, 0

    monkeypatch.setattr(tuning, "tune_block", lambda *a, **k: _trials([{L.ALGO_STANDARD: 1.0,
                                                                        L.ALGO_PERSIST_DYNAMIC: None}]))
    with pytest.raises(EngineUnavailable, match="cannot run block 0 .* refused"):
        tuning.tune_table([Runner()], None, (1,), 50, L.ALGO_PERSIST_DYNAMIC, True, 1e-3)


def test_tolerance_by_precision():
    assert tuning.tolerance("float32", False) < tuning.tolerance("float32", True) < tuning.tolerance("float16", False)
    assert tuning.tolerance("float16", False) < tuning.tolerance("bfloat16", False)
