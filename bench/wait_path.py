"""Where a lone request's time goes inside the engine process, between the engine and the scheduler.

At concurrency 1 `bench/serve.py` shows a batch taking 0.5-0.7 ms from launch to results in the
server while the engine alone (``forward`` in a tight loop) takes 0.22-0.29 ms. This times one
sequence at a time (the serving benchmark's LSTM, lengths 20..200, many-to-one) on an event loop
(uvloop) in the ways the server could wait for the GPU, each with an idle gap between requests
as at concurrency 1, and the real :class:`~service.scheduler.Scheduler` last:

    python bench/wait_path.py [--device cuda] [--reps 400] [--gap-ms 1.0]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--gap-ms", type=float, default=1.0)
    args = p.parse_args(argv)

    import serve
    from service import create_engine
    from service.eventloop import run
    from service.repository import load_model
    from service.scheduler import Scheduler, SequenceWork
    from service.scheduler.batching import finish_batch, launch_batch

    repo = Path(tempfile.mkdtemp())
    serve.write_repository(repo, 40, 128, 1)
    model = load_model(repo / "bench")
    rng = np.random.default_rng(0)
    works = [SequenceWork(rng.standard_normal((1, n, 40)).astype(np.float32), np.array([n]),
                          outputs=frozenset({"output_last"})) for n in rng.integers(20, 201, 64)]
    gap = args.gap_ms / 1e3
    rows = []

    async def timed(name: str, one) -> None:
        times = []
        for i in range(args.reps + 20):
            await asyncio.sleep(gap)
            t0 = time.perf_counter()
            await one(works[i % len(works)])
            if i >= 20:
                times.append(time.perf_counter() - t0)
        rows.append((name, 1e3 * statistics.median(times), 1e3 * float(np.percentile(times, 90))))

    async def run_all() -> None:
        for blocking in (False, True):
            engine = create_engine(model, args.device, blocking_sync=blocking) if args.device == "cuda" \
                else create_engine(model, args.device)
            pool = ThreadPoolExecutor(1)
            loop = asyncio.get_running_loop()
            kind = ("blocking-sync event" if blocking else "spinning event") if args.device == "cuda" else "no GPU"

            async def forward(w):
                engine.forward(w.x)  # as bench/serve.py times "engine alone"

            async def executor_wait(w):
                merged, launched = launch_batch(engine, [w])
                await loop.run_in_executor(pool, launched.wait)
                finish_batch(engine, merged, launched, [w])

            async def inline_wait(w):
                merged, launched = launch_batch(engine, [w])
                launched.wait()
                finish_batch(engine, merged, launched, [w])

            await timed(f"engine.forward on the loop, {kind}", forward)
            if getattr(engine, "launches", False):
                await timed(f"launch on the loop, wait on a worker thread, {kind}", executor_wait)
                await timed(f"launch and wait on the loop, {kind}", inline_wait)
            sched = Scheduler(engine, "bench", "1", max_batch_size=64, max_queue_delay_us=0, max_queue_size=64)
            await sched.start()
            await timed(f"Scheduler.enqueue (the server's path), {kind}", lambda w: sched.enqueue(w))
            await sched.stop()
            pool.shutdown()
            engine.close()
            if args.device != "cuda":
                break

    run(run_all())
    print(f"one sequence at a time, {args.gap_ms} ms idle between requests, device {args.device}, "
          f"LSTM I=40 H=128, lengths 20..200, many-to-one ({args.reps} requests per row)")
    print("| path | p50 ms | p90 ms |\n|---|--:|--:|")
    for name, p50, p90 in rows:
        print(f"| {name} | {p50:.3f} | {p90:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
