"""The benchmark's host CPU sampler: steal and CPU pressure over a window and in its worst 100 ms.

It is how a streams cell's tail is told to be the host's (another guest's work, or the host's own
processes crowding the CPUs) rather than the server's, so its arithmetic is checked on set samples,
and its reading of /proc on a live Linux host.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import procstat  # noqa: E402 - bench/procstat.py


def _sampler(samples: list[tuple[float, float, float, float | None]]) -> procstat.HostSampler:
    sampler = procstat.HostSampler()
    sampler.samples = samples
    return sampler


def test_means_over_the_window_and_the_worst_slice() -> None:
    # 0.5 s at 50 ms samples: 4 busy cores throughout; steal 0 except 0.8 cores in 0.2-0.3 s;
    # pressure 10 % except 90 % in 0.3-0.4 s.
    samples, busy, steal, pressure = [], 0.0, 0.0, 0.0
    for k in range(11):
        t = 10.0 + 0.05 * k
        samples.append((t, busy, steal, pressure))
        busy += 4 * 0.05
        steal += 0.8 * 0.05 if 10.2 <= t < 10.3 - 1e-9 else 0.0
        pressure += (0.9 if 10.3 <= t < 10.4 - 1e-9 else 0.1) * 0.05
    w = _sampler(samples).window(10.0, 10.5)
    assert w is not None
    assert w["host_busy_cores"] == pytest.approx(4.0)
    assert w["host_steal_cores"] == pytest.approx(0.8 * 0.1 / 0.5)
    assert w["host_steal_max_cores"] == pytest.approx(0.8)
    assert w["host_pressure"] == pytest.approx((0.9 * 0.1 + 0.1 * 0.4) / 0.5)
    assert w["host_pressure_max"] == pytest.approx(0.9)


def test_samples_outside_the_window_do_not_count() -> None:
    samples = [(0.0, 0.0, 0.0, 0.0), (1.0, 16.0, 8.0, 1.0),  # a busy second before the window
               (1.0, 16.0, 8.0, 1.0), (1.1, 16.1, 8.0, 1.0), (1.2, 16.2, 8.0, 1.0)]
    w = _sampler(samples).window(1.0, 1.2)
    assert w is not None
    assert w["host_busy_cores"] == pytest.approx(1.0)
    assert w["host_steal_cores"] == 0.0 and w["host_steal_max_cores"] == 0.0
    assert w["host_pressure"] == 0.0


def test_a_window_shorter_than_a_slice_and_no_pressure_counters() -> None:
    w = _sampler([(5.0, 0.0, 0.0, None), (5.04, 0.08, 0.02, None)]).window(5.0, 5.04)
    assert w is not None
    assert w["host_busy_cores"] == pytest.approx(2.0) and w["host_steal_max_cores"] == pytest.approx(0.5)
    assert w["host_pressure"] is None and w["host_pressure_max"] is None
    assert _sampler([(5.0, 0.0, 0.0, None)]).window(5.0, 6.0) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_a_live_host_reads_busy_cpus_while_this_test_spins() -> None:
    with procstat.HostSampler(period=0.01) as sampler:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.4:  # one CPU busy
            pass
        end = time.perf_counter()
    w = sampler.window(start, end)
    assert w is not None
    assert 0.5 <= w["host_busy_cores"] <= len(__import__("os").sched_getaffinity(0)) + 0.5
    assert w["host_steal_cores"] >= 0.0
