"""What a batch size's first call costs on a freshly loaded cuDNN engine, next to its second call.

A server meets new batch sizes while it serves: the first stream chunks of a run come in batches of
1, 2, 3... chunks. A call that is the first of its kind can load cuDNN kernels (CUDA loads a module's
kernels when they are first launched) or compile CuPy kernels, on the engine process's event loop,
where every request waits for it. This loads the streaming benchmark's LSTM (bench/serve.py:
I=40, H=256, 2 layers, max_batch_size 256) as the server does, then for each batch size times the
first and the second call of a stateful chunk (states from and to the engine's state pool) and of a
stateless one (h_0/c_0 given, h_n/c_n returned), equal lengths as stream chunks have. Kernels CuPy
compiled are cached on disk (CUPY_CACHE_DIR): point it at an empty folder to see a fresh machine. Run
it under ``py-spy record --native`` to see what a slow first call does (that found the copy kernel
CuPy compiled for a download, bench/results/h100-2026-11-23c/).

    CUPY_CACHE_DIR=$(mktemp -d) python bench/first_calls.py --device cuda
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _ms(call) -> float:
    start = time.perf_counter()
    call()
    return 1e3 * (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")],
                   default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64])
    p.add_argument("--steps", type=int, default=10, help="time steps per chunk (default 10)")
    p.add_argument("--precision", choices=["float32", "float16", "bfloat16"], default=None,
                   help="the cuDNN engine's storage precision (default: the model's config, float32)")
    args = p.parse_args()

    import serve
    from service import create_engine
    from service.engines.state_pool import PooledRows
    from service.repository import load_model

    repo = Path(tempfile.mkdtemp(prefix="rnnserve-first-calls-"))
    serve.write_stream_model(repo, 40, 256, 2)
    model = load_model(repo / "bench_stream", 1)
    start = time.perf_counter()
    options = {"precision": args.precision} if args.device == "cuda" and args.precision else {}
    engine = create_engine(model, args.device, blocking_sync=True, **options)
    load_ms = 1e3 * (time.perf_counter() - start)
    import gc

    from service.heap import freeze_heap

    freeze_heap()  # as the server does once its models are loaded
    pauses: list[float] = []
    gc_start = [0.0]
    gc.callbacks.append(lambda phase, info: gc_start.__setitem__(0, time.perf_counter()) if phase == "start"
                        else pauses.append(time.perf_counter() - gc_start[0]))
    spec = engine.spec
    pool = engine.state_pool(max(args.batches))
    rng = np.random.default_rng(0)
    in_use = ""
    if args.device == "cuda":
        free, total = engine._cp.cuda.runtime.memGetInfo()
        in_use = f" ({(total - free) / 2**20:.0f} MiB of device memory in use)"
    print(f"first calls: LSTM I=40 H=256 L=2 on {engine.name} ({getattr(engine, 'precision', 'float32')}), loaded in {load_ms:.0f} ms{in_use}, "
          f"{args.steps}-step chunks, equal lengths; ms per call (outputs on the host)")
    print("| batch | stateful 1st | stateful 2nd | stateless 1st | stateless 2nd |")
    print("|--:|--:|--:|--:|--:|")
    for n in args.batches:
        x = rng.standard_normal((n, args.steps, spec.input_size)).astype(np.float32)
        lens = np.full(n, args.steps, dtype=np.int64)
        slots = [pool.acquire() for _ in range(n)]
        start_rows = PooledRows.of(pool, n, [], [(row, slot) for row, slot in enumerate(slots)])
        next_rows = PooledRows.of(pool, n, [(slot, row) for row, slot in enumerate(slots)],
                                  [(row, slot) for row, slot in enumerate(slots)])
        stateful = [_ms(lambda: engine.forward_pooled(x, lens, None, None, start_rows, states_needed=False)),
                    _ms(lambda: engine.forward_pooled(x, lens, None, None, next_rows, states_needed=False))]
        for slot in slots:
            pool.release(slot)
        h0 = np.zeros((n, spec.state_layers, spec.state_size), np.float32)
        c0 = np.zeros((n, spec.cell_state_layers, spec.cell_state_size), np.float32)
        stateless = [_ms(lambda: engine.forward(x, lens, h0, c0)) for _ in range(2)]
        print(f"| {n} | {stateful[0]:.2f} | {stateful[1]:.2f} | {stateless[0]:.2f} | {stateless[1]:.2f} |")
    print(f"garbage collections while timing: {len(pauses)}, longest {1e3 * max(pauses, default=0):.1f} ms")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
