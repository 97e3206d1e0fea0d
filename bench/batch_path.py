"""Where one scheduler batch spends its time on the engine: merge, forward, split.

Builds the serving benchmark's LSTM (bench/serve.py), forms batches of N ragged
requests asking for ``output_last`` (lengths 20..200) and times each phase, alone
and with a second thread that keeps the GIL busy the way a loaded event loop does.

    python bench/batch_path.py --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,8,22,64")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--switch-ms", type=float, default=0.2, help="sys.setswitchinterval, in ms (the server's: 0.2)")
    args = p.parse_args()
    import serve
    from service import create_engine
    from service.repository import load_model
    from service.scheduler.batching import SequenceWork, merge, split

    tmp = tempfile.TemporaryDirectory()
    repo = Path(tmp.name)
    serve.write_repository(repo, 40, 128, 1)
    engine = create_engine(load_model(repo / "bench"), args.device, blocking_sync=True)
    rng = np.random.default_rng(0)
    sys.setswitchinterval(args.switch_ms / 1000)
    print(f"switch interval {args.switch_ms} ms, device {args.device}")
    print("| batch | states | busy thread | merge ms | forward ms | split ms | total ms | plan |")
    print("|---:|---|---|---:|---:|---:|---:|---|")
    for n in (int(b) for b in args.batches.split(",")):
        parts = [SequenceWork(rng.standard_normal((1, int(t), 40)).astype(np.float32), np.array([int(t)]),
                              outputs=frozenset({"output_last"})) for t in rng.integers(20, 201, n)]
        for states in (False, True):
            for busy in (False, True):
                stop = threading.Event()

                def spin() -> None:
                    x = 0
                    while not stop.is_set():
                        x += 1

                th = threading.Thread(target=spin, daemon=True)
                if busy:
                    th.start()
                m, f, s = [], [], []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    batch = merge(parts)
                    t1 = time.perf_counter()
                    out = (engine.forward(batch.x, batch.lengths, states_needed=states) if engine.skips_states
                           else engine.forward(batch.x, batch.lengths))
                    t2 = time.perf_counter()
                    split(engine.spec, batch, out.output, out.h_n, out.c_n, parts)
                    t3 = time.perf_counter()
                    m.append(t1 - t0), f.append(t2 - t1), s.append(t3 - t2)
                stop.set()
                if busy:
                    th.join()
                plan_desc = "-"
                if hasattr(engine, "_table"):
                    from service.engines.cudnn.autotune import plan

                    groups = plan(engine._table, n, int(batch.x.shape[1]), batch.lengths, not states)
                    plan_desc = f"{len(groups)} group(s), algos {groups[0].algos}, uniform {groups[0].uniform}"
                med = [1e3 * statistics.median(v) for v in (m, f, s)]
                print(f"| {n} | {'kept' if states else 'skipped'} | {'yes' if busy else 'no'} | {med[0]:.3f} | "
                      f"{med[1]:.3f} | {med[2]:.3f} | {sum(med):.3f} | {plan_desc} |", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
