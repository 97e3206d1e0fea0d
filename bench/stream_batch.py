"""Host and GPU time of one stream batch, per cuDNN algorithm: where a small batch's time goes.

Builds the streaming scenario's LSTM (bench/serve.py: I=40, H=256, 2 layers), gathers
N streams' states from their state pool slots and runs one 10-step chunk each, leaving the
new states in the slots (``launch(..., pooled=)``, what the scheduler does for a batch of
stream chunks, the PooledRows built inside the timed host part), with each algorithm forced in
turn and with the autotuner's choice, with CUDA graphs ("on": the cuDNN calls replay a graph, the
copies and state moves around it are separate calls; "fused": the whole call, copies and state moves
included, is one graph, see service/engines/cudnn/fused.py) and without ("off"). The same shape repeats
here, so after its first calls each batch is one graph replay. Columns: host ms (the calls' own time on the
calling thread, which in the server is the event loop), wall ms (until the outputs are
on the host), GPU ms (CUDA events around the same calls). Medians over --reps calls.

    python bench/stream_batch.py --device cuda
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()
    import cupy as cp

    import serve
    from service.engines.cudnn import CudnnEngine
    from service.engines.state_pool import PooledRows
    from service.errors import EngineUnavailable
    from service.repository import load_model

    tmp = tempfile.TemporaryDirectory()
    repo = Path(tmp.name)
    serve.write_stream_model(repo, 40, 256, 2)
    model = load_model(repo / "bench_stream")
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"stream batch: LSTM I=40 H=256 L=2, T={args.steps}, states from the previous chunk, median of {args.reps}")
    print("| algorithm | CUDA graphs | B | chosen | host ms | wall ms | GPU ms |")
    print("|---|---|--:|---|--:|--:|--:|")
    for algorithm, graphs in ((None, "fused"), (None, "on"), (None, "off"), ("standard", "fused"),
                              ("standard", "on"), ("standard", "off"), ("persist_static", "fused"),
                              ("persist_dynamic", "fused")):
        try:
            engine = CudnnEngine(model, algorithm=algorithm, max_batch_size=max(batches), blocking_sync=True,
                                 graph_memory_mb=0 if graphs == "off" else None, fused=graphs == "fused")
        except EngineUnavailable as exc:
            print(f"| {algorithm} | {graphs} | - | refused: {exc} | | | |")
            continue
        try:
            for n in batches:
                x = rng.standard_normal((n, args.steps, 40)).astype(np.float32)
                pool = engine.state_pool(n)
                slots = [pool.acquire() for _ in range(n)]
                engine.forward_pooled(x, None, None, None, PooledRows.of(pool, n, [], list(enumerate(slots))),
                                      states_needed=False)
                host, wall, gpu = [], [], []
                for _ in range(args.reps):
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    t0 = time.perf_counter()
                    start.record(engine._ctx.stream)
                    pooled = PooledRows.of(pool, n, [(s, row) for row, s in enumerate(slots)], list(enumerate(slots)))
                    launched = engine.launch(x, None, None, None, states_needed=False, pooled=pooled)
                    end.record(engine._ctx.stream)
                    t1 = time.perf_counter()
                    launched.wait()
                    launched.finish()
                    t2 = time.perf_counter()
                    host.append(t1 - t0)
                    wall.append(t2 - t0)
                    gpu.append(cp.cuda.get_elapsed_time(start, end) / 1000)
                chosen = "/".join(sorted(set(engine.algorithms_for(n, args.steps))))
                print(f"| {algorithm or 'autotuned'} | {graphs} | {n} | {chosen} | {1e3 * statistics.median(host):.3f} | "
                      f"{1e3 * statistics.median(wall):.3f} | {1e3 * statistics.median(gpu):.3f} |", flush=True)
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
