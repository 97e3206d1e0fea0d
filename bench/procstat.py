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


class CpuSampler:
    """Samples the CPU seconds of process ``pid`` and of its children (the front-ends) until stopped."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid = pid
        self.period = period
        self._samples: list[tuple[float, ...]] = []  # (wall time, engine s, its main thread s, front-ends s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")
        self.available = _cpu_seconds(pid) is not None

    def __enter__(self) -> "CpuSampler":
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            engine = _cpu_seconds(self.pid)
            if engine is None:
                return
            main = _cpu_seconds(self.pid, self.pid) or 0.0
            fronts = sum(s for s in map(_cpu_seconds, _children(self.pid)) if s is not None)
            self._samples.append((time.time(), engine, main, fronts))
            self._stop.wait(self.period)

    def cores(self, start: float, end: float) -> tuple[float, float, float] | None:
        """(engine process, its main thread, all front-ends): cores used between wall times ``start`` and
        ``end``. The main thread runs the engine process's event loop, batching and launches: near 1.0 it
        is what limits the server."""
        times = [s[0] for s in self._samples]
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if i >= j:
            return None
        a, b = self._samples[i], self._samples[j]
        return tuple((b[k] - a[k]) / (b[0] - a[0]) for k in (1, 2, 3))  # type: ignore[return-value]
