"""Keep Python's garbage collector off the request path of a long-running server.

A server process holds a large, permanent heap once its models are loaded (CuPy,
NumPy, gRPC, FastAPI, the engines), and every full collection walks all of it while
requests wait: each request allocates enough small objects to trigger collections
often. :func:`freeze_heap` moves everything alive at that point into the collector's
permanent generation (``gc.freeze``, CPython's tool for exactly this), so later
collections walk only what requests allocated.

Every process also logs a collection that paused it for longer than
:data:`SLOW_GC_S` (a ``gc.callbacks`` hook): such a pause delays every request the
process holds at that moment, and shows up as a latency spike nothing else explains.
At ``--log-level debug`` it logs them from :data:`NOTE_GC_S` on.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("rnnserve.heap")

SLOW_GC_S = 0.010
NOTE_GC_S = 0.002  # logged at debug level from here


class _PauseLog:
    """A ``gc.callbacks`` hook: logs collections longer than ``threshold_s``."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        paused = time.perf_counter() - self._start
        if paused >= self.threshold_s:
            level = logging.WARNING
        elif paused >= NOTE_GC_S and log.isEnabledFor(logging.DEBUG):
            level = logging.DEBUG
        else:
            return
        log.log(level, "a garbage collection (generation %d, %d objects freed) paused this process for %.1f ms",
                info.get("generation", -1), info.get("collected", 0), 1e3 * paused)


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from future collections."""
    gc.collect()
    gc.freeze()
    if not any(isinstance(cb, _PauseLog) for cb in gc.callbacks):
        gc.callbacks.append(_PauseLog(SLOW_GC_S))
    log.debug("heap frozen: %d objects exempt from garbage collection", gc.get_freeze_count())
