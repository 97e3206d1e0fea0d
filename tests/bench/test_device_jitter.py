"""bench/device_jitter.py: which calls it lists as slow, and when they came (its GPU loop needs a device)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import device_jitter  # noqa: E402 - bench/device_jitter.py


def test_slow_calls_are_listed_with_their_time_since_the_first_call():
    times = [100.0, 100.001, 101.6, 103.2]
    wall = [0.0002, 0.012, 0.0049, 0.005]
    gpu = [0.0001, 0.0115, 0.0001, 0.0002]
    got = device_jitter.slow_calls(times, wall, gpu, 0.005)
    assert [round(s, 3) for s, _, _ in got] == [0.001, 3.2]
    assert got[0][1:] == pytest.approx((12.0, 11.5)) and got[1][1:] == pytest.approx((5.0, 0.2))
    assert device_jitter.slow_calls([], [], [], 0.005) == []
