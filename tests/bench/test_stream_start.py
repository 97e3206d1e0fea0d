"""The streams benchmark's load-generating processes start their paced streams together.

Each process spreads its share of the streams over one interval from the start time; processes that
started apart made the slices overlap and leave holes (bench/results/h100-2026-11-23h/README.md).
"""
from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import serve  # noqa: E402 - bench/serve.py


def _ready_after(start, delay: float, out) -> None:
    time.sleep(delay)
    ready = time.perf_counter()
    out.put((delay, ready, start()))


def test_processes_that_get_ready_apart_start_at_one_time() -> None:
    ctx = multiprocessing.get_context("fork")
    start, out = serve.CommonStart(ctx, 3), ctx.Queue()
    procs = [ctx.Process(target=_ready_after, args=(start, d, out)) for d in (0.0, 0.15, 0.3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    starts = {s for _, _, s in got}
    assert len(starts) == 1  # one value, not each process's own clock
    last_ready = max(ready for _, ready, _ in got)
    assert last_ready < starts.pop() <= last_ready + 0.05
