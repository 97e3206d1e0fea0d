"""DeviceClock: the predicted end of queued device work, learned from finished batches."""
from __future__ import annotations

import pytest

from service.scheduler.device_clock import MARGIN_S, DeviceClock


def test_the_clock_learns_time_per_step_and_queues_batches_behind_each_other():
    clock = DeviceClock()
    clock.launched(0.0, 0.001, 100)  # nothing learned yet: no hold
    assert clock.form_at() < 0.001
    clock.finished(0.001, 0.012, 100)  # 11 ms for 100 steps after the launch returned
    assert clock.per_step == pytest.approx(0.00011)
    clock.launched(1.0, 1.001, 100)
    assert clock.free_at == pytest.approx(1.012)
    clock.launched(1.002, 1.003, 50)  # queued behind the first: starts when it ends
    assert clock.free_at == pytest.approx(1.012 + 0.0055)
    assert clock.form_at() == pytest.approx(clock.free_at - clock.lead - MARGIN_S)
    # the second batch's time counts from the first one's end, not from its own launch
    clock.finished(1.001, 1.012, 100)
    clock.finished(1.003, 1.012 + 0.0055, 50)
    assert clock.per_step == pytest.approx(0.00011, rel=0.05)


def test_when_the_last_batch_is_done_the_device_is_free_whatever_was_predicted():
    clock = DeviceClock()
    clock.launched(0.0, 0.001, 10)
    clock.finished(0.001, 0.011, 10)  # 1 ms per step
    clock.launched(1.0, 1.001, 10)  # predicted to end at 1.011
    clock.launched(1.002, 1.003, 10)  # behind it: 1.021
    clock.finished(1.001, 1.004, 10)  # the first ended early
    assert clock.free_at == pytest.approx(1.021)  # the second still runs: its prediction stands
    clock.finished(1.003, 1.006, 10)  # the last launched batch is done: the device is free
    assert clock.free_at == pytest.approx(1.006)
    clock.launched(1.0061, 1.007, 10)  # a new batch starts at its own launch, not behind the old prediction
    assert clock.free_at == pytest.approx(1.007 + clock.device_s)


def test_host_bound_when_launching_takes_longer_than_the_device():
    clock = DeviceClock()
    assert not clock.host_bound()  # nothing learned yet
    clock.launched(0.0, 0.001, 10)
    clock.finished(0.001, 0.0015, 10)  # 0.05 ms per step
    clock.launched(1.0, 1.001, 10)  # 1 ms to launch, 0.5 ms on the device
    assert clock.host_bound()
    clock.launched(2.0, 2.0002, 200)  # 0.2 ms to launch (averaged), 10 ms on the device
    assert not clock.host_bound()
