"""Does the GPU (or its driver) stall now and then, with no server around? One stream batch, over and over.

Builds the streaming scenario's LSTM (bench/serve.py: I=40, H=256, 2 layers) on the cuDNN
engine and launches one pooled batch of ``--batch`` streams' 10-step chunks (what the
scheduler launches under 256 paced streams) every ``--gap-ms`` for ``--seconds``, waiting for
each. Each call's wall time (launch to outputs on the host) and GPU time (CUDA events around
it) are kept. A call far slower than the median tells which side stalled: GPU time as long as
the wall time means the device ran it slowly (clocks, another process's work, the driver), a
short GPU time means the host thread was held (scheduling, the driver's host side). The
slow calls are listed with when they came, so a period (a monitoring agent polling the GPU,
say) shows. A server's streams p99 cannot be better than what this shows for the host.

    python bench/device_jitter.py --seconds 8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def slow_calls(times: list[float], wall: list[float], gpu: list[float], slow_s: float) -> list[tuple[float, float, float]]:
    """(seconds since the first call, wall ms, GPU ms) of every call whose wall time reached ``slow_s``."""
    t0 = times[0] if times else 0.0
    return [(t - t0, 1e3 * w, 1e3 * g) for t, w, g in zip(times, wall, gpu) if w >= slow_s]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2, help="streams per batch (default 2, as 256 paced streams give)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--gap-ms", type=float, default=0.4, help="host sleep between calls (default 0.4)")
    p.add_argument("--slow-ms", type=float, default=5.0, help="list calls at least this slow (default 5)")
    args = p.parse_args()
    import cupy as cp

    import serve
    from service.engines.cudnn import CudnnEngine
    from service.engines.state_pool import PooledRows
    from service.repository import load_model

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        serve.write_stream_model(repo, 40, 256, 2)
        model = load_model(repo / "bench_stream")
    engine = CudnnEngine(model, max_batch_size=64)
    n = args.batch
    x = np.random.default_rng(0).standard_normal((n, args.steps, 40)).astype(np.float32)
    pool = engine.state_pool(256)
    slots = [pool.acquire() for _ in range(n)]
    times, wall, gpu = [], [], []
    try:
        engine.forward_pooled(x, None, None, None, PooledRows.of(pool, n, [], list(enumerate(slots))),
                              states_needed=False)
        end_at = time.perf_counter() + args.seconds
        while time.perf_counter() < end_at:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            t0 = time.perf_counter()
            start.record(engine._ctx.stream)
            pooled = PooledRows.of(pool, n, [(s, row) for row, s in enumerate(slots)], list(enumerate(slots)))
            launched = engine.launch(x, None, None, None, states_needed=False, last_only=True, pooled=pooled)
            end.record(engine._ctx.stream)
            launched.wait()
            launched.finish()
            t1 = time.perf_counter()
            times.append(t0)
            wall.append(t1 - t0)
            gpu.append(cp.cuda.get_elapsed_time(start, end) / 1000)
            time.sleep(args.gap_ms / 1000)
    finally:
        engine.close()
    w = np.asarray(wall) * 1e3
    g = np.asarray(gpu) * 1e3
    slow = slow_calls(times, wall, gpu, args.slow_ms / 1000)
    print(f"device jitter: LSTM I=40 H=256 L=2, batch {n} x {args.steps} steps, pooled states, many-to-one, "
          f"{len(w)} calls over {args.seconds:.0f} s, {args.gap_ms} ms apart")
    print("| calls | wall p50 ms | wall p99 ms | wall max ms | GPU p50 ms | GPU max ms | calls >= 5 ms | calls >= 10 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(w)} | {statistics.median(w):.3f} | {np.percentile(w, 99):.3f} | {w.max():.2f} | "
          f"{statistics.median(g):.3f} | {g.max():.2f} | {(w >= 5).sum()} | {(w >= 10).sum()} |")
    if slow:
        print(f"calls >= {args.slow_ms:g} ms (s since start: wall / GPU ms): "
              + ", ".join(f"{s:.2f}: {a:.1f}/{b:.1f}" for s, a, b in slow[:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
