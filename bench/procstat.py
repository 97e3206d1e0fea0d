"""Where a benchmark cell's CPU went: the engine process, its front-end processes, the load generator.

A closed-loop benchmark is limited by whichever stage saturates first; on a shared host the
load generator and the server's processes compete for the same cores. :class:`CpuSampler`
reads ``/proc`` (Linux; elsewhere it reports nothing) every ``period`` seconds in a thread,
and :meth:`CpuSampler.cores` gives the cores each side used over a window of wall-clock
time (``time.time()``), the measured window of a cell that its client processes report.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """utime + stime of ``pid`` (all its threads; only thread ``tid`` if given), or None when it is gone
    or /proc is missing."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5), after pid and comm


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        return []
    return kids


class _Sampler:
    """A thread that appends ``_sample()`` to ``samples`` every ``period`` seconds, inside a ``with``,
    until ``_sample`` returns None (its source is gone) or the block ends."""

    def __init__(self, period: float, available: bool) -> None:
        self.period = period
        self.samples: list[tuple] = []
        self.available = available
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=type(self).__name__)

    def _sample(self) -> tuple | None:
        raise NotImplementedError

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self._sample()
            if sample is None:
                return
            self.samples.append(sample)
            self._stop.wait(self.period)


class CpuSampler(_Sampler):
    """Samples the CPU seconds of process ``pid`` and of its children (the front-ends) until stopped.

    ``samples``: (wall time, engine s, its main thread s, front-ends s).
    """

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid = pid
        super().__init__(period, _cpu_seconds(pid) is not None)

    def _sample(self) -> tuple | None:
        engine = _cpu_seconds(self.pid)
        if engine is None:
            return None
        main = _cpu_seconds(self.pid, self.pid) or 0.0
        fronts = sum(s for s in map(_cpu_seconds, _children(self.pid)) if s is not None)
        return time.time(), engine, main, fronts

    def cores(self, start: float, end: float) -> tuple[float, float, float] | None:
        """(engine process, its main thread, all front-ends): cores used between wall times ``start`` and
        ``end``. The main thread runs the engine process's event loop, batching and launches: near 1.0 it
        is what limits the server."""
        times = [s[0] for s in self.samples]
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if i >= j:
            return None
        a, b = self.samples[i], self.samples[j]
        return tuple((b[k] - a[k]) / (b[0] - a[0]) for k in (1, 2, 3))  # type: ignore[return-value]


def _host_counters() -> tuple[float, float, float | None] | None:
    """(busy, steal) CPU seconds of the whole host since boot and CPU pressure ("some" stall seconds), or
    None without /proc/stat. Pressure is None where the kernel has no PSI (/proc/pressure/cpu)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields]
    # user nice system idle iowait irq softirq steal: guest time is already inside user and nice
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6)) / _TICK
    steal = (ticks[7] if len(ticks) > 7 else 0) / _TICK
    try:
        some = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        pressure: float | None = int(some.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        pressure = None
    return busy, steal, pressure


class HostSampler(_Sampler):
    """Samples host-wide CPU counters until stopped, to tell a host's own stalls from the server's.

    On a virtual machine a hypervisor that runs other guests' work shows up as *steal*; processes
    that wait for a CPU because the host's own processes took them all show up as CPU *pressure*
    (PSI "some": the share of time at least one runnable task had no CPU). A tail that comes with
    either in the same 100 ms is the host's, not the server's. Times are ``time.perf_counter()``
    (CLOCK_MONOTONIC, one clock for every process), as the streams benchmark's send times.
    """

    def __init__(self, period: float = 0.02) -> None:
        super().__init__(period, _host_counters() is not None)

    def _sample(self) -> tuple | None:  # (time, busy s, steal s, pressure s or None)
        counters = _host_counters()
        return None if counters is None else (time.perf_counter(), *counters)

    def window(self, start: float, end: float, slice_s: float = 0.1) -> dict | None:
        """Host CPU between ``start`` and ``end``: mean busy and steal cores and pressure share, and the
        most steal and pressure in any ``slice_s`` slice of it (None without two samples in the window).

        /proc/stat counts in ticks (10 ms of one CPU), so steal in a 100 ms slice comes in steps of 0.1 core.
        """
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return None

        def rates(a: tuple, b: tuple) -> tuple[float, float, float | None]:
            dt = b[0] - a[0]
            pressure = None if a[3] is None or b[3] is None else (b[3] - a[3]) / dt
            return (b[1] - a[1]) / dt, (b[2] - a[2]) / dt, pressure

        busy, steal, pressure = rates(inside[0], inside[-1])
        slices, first = [], inside[0]
        for s in inside[1:]:
            if s[0] - first[0] >= slice_s - 1e-6:  # not lost to rounding of the sample times
                slices.append(rates(first, s))
                first = s
        if not slices:  # a window shorter than one slice
            slices.append((busy, steal, pressure))
        pressures = [p for _, _, p in slices if p is not None]
        return {"host_busy_cores": busy, "host_steal_cores": steal, "host_pressure": pressure,
                "host_steal_max_cores": max(st for _, st, _ in slices),
                "host_pressure_max": max(pressures) if pressures else None}
