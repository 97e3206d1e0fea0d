"""DeviceClock: the predicted end of queued device work, learned from finished batches."""
from __future__ import annotations

import pytest

from service.scheduler.device_clock import MARGIN_S, DeviceClock


def test_the_clock_learns_time_per_step_and_queues_batches_behind_each_other():
    clock = DeviceClock()
    clock.launched(0.0, 0.001, 100)  # nothing learned yet: no hold
    assert clock.form_at() < 0.001
    clock.finished(0.0, 0.011, 100)  # 11 ms for 100 steps
    assert clock.per_step == pytest.approx(0.00011)
    clock.launched(1.0, 1.001, 100)
    assert clock.free_at == pytest.approx(1.011)
    clock.launched(1.002, 1.003, 50)  # queued behind the first: starts when it ends
    assert clock.free_at == pytest.approx(1.011 + 0.0055)
    assert clock.form_at() == pytest.approx(clock.free_at - clock.lead - MARGIN_S)
    # the second batch's time counts from the first one's end, not from its own launch
    clock.finished(1.0, 1.012, 100)
    clock.finished(1.002, 1.012 + 0.0055, 50)
    assert clock.per_step == pytest.approx(0.00011, rel=0.05)
