"""Keep Python's garbage collector off the request path of a long-running server.

A server process holds a large, permanent heap once its models are loaded (CuPy,
NumPy, gRPC, FastAPI, the engines), and every full collection walks all of it while
requests wait: each request allocates enough small objects to trigger collections
often. :func:`freeze_heap` moves everything alive at that point into the collector's
permanent generation (``gc.freeze``, CPython's tool for exactly this), so later
collections walk only what requests allocated.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger("rnnserve.heap")


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from future collections."""
    gc.collect()
    gc.freeze()
    log.debug("heap frozen: %d objects exempt from garbage collection", gc.get_freeze_count())
