"""Running each batch path of a freshly built cuDNN engine once, before it serves.

CuPy compiles a kernel (NVRTC, tens of ms) the first time an indexing pattern or dtype
meets it; profiled under load on an H200, that was 7 % of the first seconds of serving,
and a long stall for the requests of those batches. The warm-up runs ragged groups,
padded runs, many-to-one outputs and stream states once per batch bucket at load.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..state_pool import PooledRows
from .copies import warm

log = logging.getLogger("rnnserve.engines.cudnn")


def warm_paths(engine: Any, steps: int) -> None:
    """Compile the engine's kernels and run its batch paths once; a failure is logged, not raised."""
    warm(engine._cp)
    try:
        _run_warm_batches(engine, max(2, steps))
    except Exception as exc:  # noqa: BLE001 - a shape it cannot run fails that request, not the load
        log.warning("model %s: warming the batch paths failed (%s: %s); kernels compile on first use",
                    engine.model.name or "?", type(exc).__name__, exc)


def _run_warm_batches(engine: Any, t: int) -> None:
    feat = engine.spec.blocks[0].input_size
    for b in engine._buckets:
        if b < 4:
            continue
        x = np.zeros((b, t, feat), np.float32)
        lens = np.where(np.arange(b) % 2 == 0, t, 1).astype(np.int64)
        engine.forward(x, lens)
        engine.forward(x, lens, last_only=True)
        if engine.spec.causal:
            engine.forward(x, lens, states_needed=False)
            engine.forward(x, lens, states_needed=False, last_only=True)
        pool = engine.state_pool(b)
        slots = [pool.acquire() for _ in range(b)]
        first = PooledRows.of(pool, b, [], [(row, slot) for row, slot in enumerate(slots)])
        engine.forward_pooled(x, lens, None, None, first, states_needed=False)
        later = PooledRows.of(pool, b, [(slot, row) for row, slot in enumerate(slots) if row % 2],
                              [(row, slot) for row, slot in enumerate(slots)])
        engine.forward_pooled(x, lens, None, None, later, states_needed=False, last_only=True)
    engine._ctx.stream.synchronize()
