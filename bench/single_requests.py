"""Single many-to-one requests of random lengths on a freshly loaded cuDNN engine: how soon they replay graphs.

What ``max_batch_size`` 1 and light load send the engine: one sequence of 20..200 steps per call, asking
for ``output_last``. This loads the serving benchmark's model (bench/serve.py: an LSTM with I=40, H=128, one
layer, unless --hidden/--layers say otherwise) as the server does and makes ``--calls`` such calls back to
back, each from the host to the answer on the host, and reports the host-to-host time of the calls in
windows of ``--window`` calls, with how many graphs the engine had captured and how many calls replayed
a fused graph by the end of each window. Run it from two checkouts to compare them (the script puts the
checkout it lies in first on the path):

    python bench/single_requests.py --calls 3000
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--window", type=int, default=500)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import serve
    from service import create_engine
    from service.repository import load_model

    repo = Path(tempfile.mkdtemp(prefix="rnnserve-single-requests-"))
    serve.write_repository(repo, 40, args.hidden, args.layers)
    model = load_model(repo / "bench_nobatch", 1)
    engine = create_engine(model, "cuda", blocking_sync=True)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(20, 201, args.calls)
    xs = [rng.standard_normal((1, int(t), 40)).astype(np.float32) for t in lengths]
    print(f"rnnserve single requests: LSTM I=40 H={args.hidden} L={args.layers}, {args.calls} calls of one sequence "
          f"of 20..200 steps (output_last), host to host, from a freshly loaded engine ({ROOT})")
    print("| calls | ms p50 | ms p90 | ms p99 | graphs captured so far | fused replays so far |")
    print("|---|---:|---:|---:|---:|---:|")
    times: list[float] = []
    try:
        for i, (x, t) in enumerate(zip(xs, lengths)):
            start = time.perf_counter()
            launched = engine.launch(x, np.array([t]), states_needed=False, last_only=True)
            launched.wait()
            launched.finish()
            times.append(1e3 * (time.perf_counter() - start))
            if (i + 1) % args.window == 0:
                w = np.array(times[-args.window:])
                info = engine.describe()
                graphs = info.get("cuda_graphs") or {}
                captured = f"{graphs.get('captures', '-')} ({graphs.get('graphs', '-')} kept)"
                print(f"| {i + 1 - args.window + 1}-{i + 1} | {np.percentile(w, 50):.3f} | {np.percentile(w, 90):.3f} "
                      f"| {np.percentile(w, 99):.3f} | {captured} | {info.get('fused_calls', '-')} |")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
