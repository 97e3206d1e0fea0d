"""bench/serve.py's summary of what the started server logged during a cell: stalls, GC pauses, captures."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import serve  # noqa: E402 - bench/serve.py


def test_stalls_are_summed_up_by_kind_and_by_the_process_that_logged_them():
    lines = [
        "2026-11-23 20:00:00,100 WARNING rnnserve.eventloop[engine 41]: this process's event loop was blocked for "
        "about 23 ms\n",
        "2026-11-23 20:00:01,700 DEBUG rnnserve.eventloop[frontend 42]: this process's event loop was blocked for "
        "about 7 ms\n",
        "2026-11-23 20:00:01,700 DEBUG rnnserve.eventloop[frontend 43]: this process's event loop was blocked for "
        "about 6 ms\n",
        "2026-11-23 20:00:02,000 INFO rnnserve.engines.cudnn.graphs[engine 41]: captured a CUDA graph for fused n=4 "
        "t=10 in 12.5 ms (9 graphs, 1.0 of 512 MB, 0 evicted so far)\n",
        "2026-11-23 20:00:03,000 DEBUG rnnserve.heap: a garbage collection (generation 2, 0 objects freed) paused this "
        "process for 2.4 ms\n",
        "an unrelated line\n",
    ]
    assert serve._stalls(lines) == ("3 event-loop stalls logged (engine 1, frontend 2), max 23 ms; "
                                    "1 GC pauses logged (server 1), max 2 ms; "
                                    "1 CUDA graph captures logged (engine 1), max 12 ms")
    assert serve._stalls(["an unrelated line\n"]) == ""
