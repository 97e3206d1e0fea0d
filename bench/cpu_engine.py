"""Benchmark: rnnserve's NumPy reference engine vs torch.nn.LSTM/GRU on the same CPU cores.

Prints a table and writes JSON (--out). Both sides use float32, the same weights,
the same input, and the machine's default thread count (set --threads to pin both).

    python bench/cpu_engine.py [--threads 2] [--repeats 5] [--out bench/results/cpu_engine.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service import create_engine  # noqa: E402
from service.packing import LayerWeights, pack_block  # noqa: E402
from service.repository import PackedModel  # noqa: E402
from service.spec import BlockSpec, RNNSpec  # noqa: E402


def packed_from_torch(mod, cell: str) -> PackedModel:
    sd = {k: v.detach().double().numpy() for k, v in mod.state_dict().items()}
    spec = BlockSpec(cell, mod.input_size, mod.hidden_size, mod.num_layers)
    layers = [LayerWeights(sd[f"weight_ih_l{k}"], sd[f"weight_hh_l{k}"], sd[f"bias_ih_l{k}"], sd[f"bias_hh_l{k}"])
              for k in range(mod.num_layers)]
    return PackedModel(RNNSpec((spec,)), [pack_block(spec, layers)])


# Pause between the two sides' blocks: PyTorch's OpenMP workers keep spinning for a while after
# a call, and rnnserve's two kernel threads meet at a barrier every step, so a block started
# while they still spin on both cores measured up to 3x slow on this 2-core machine (0.05 s was too short).
PAUSE_S = 0.3


def timeit_pair(ours, theirs, repeats: int, rounds: int = 3) -> tuple[float, float]:
    """Best-of-``rounds`` median ms of each side.

    Each side runs in its own block, with a pause between blocks: OpenBLAS's and PyTorch's
    thread pools both spin after a call, and interleaving single calls makes each side
    pay for the other's spinning threads on 2 cores.
    """
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for k, fn in enumerate((ours, theirs)):
            fn()
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            best[k] = min(best[k], statistics.median(samples) * 1e3)
            time.sleep(PAUSE_S)
    return best[0], best[1]


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time", type=int, default=100)
    ap.add_argument("--cells", default="lstm,gru", help="comma-separated subset of lstm,gru")
    ap.add_argument("--out", type=Path, default=Path("bench/results/cpu_engine.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}, "
          f"T={args.time}, float32, best of 3 medians of {args.repeats}")
    print(f"{'cell':<5}{'H':>6}{'L':>3}{'B':>5}{'rnnserve ms':>13}{'torch ms':>10}{'speed vs torch':>16}")
    cells = [c for c in ("lstm", "gru") if c in args.cells.split(",")]
    for cell, module in ((c, {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[c]) for c in cells):
        for hidden in (128, 512):
            for layers in (1, 2):
                torch.manual_seed(0)
                mod = module(hidden, hidden, num_layers=layers, batch_first=True).eval()
                engine = create_engine(packed_from_torch(mod, cell), "cpu")
                for batch in (1, 16, 64):
                    x = np.random.default_rng(0).standard_normal((batch, args.time, hidden)).astype(np.float32)
                    xt = torch.from_numpy(x)
                    with torch.inference_mode():
                        ours, theirs = timeit_pair(lambda: engine.forward(x), lambda: mod(xt), args.repeats)
                    ratio = theirs / ours
                    rows.append({"cell": cell, "hidden": hidden, "layers": layers, "batch": batch, "time": args.time,
                                 "rnnserve_ms": ours, "torch_ms": theirs, "speed_vs_torch": ratio})
                    print(f"{cell:<5}{hidden:>6}{layers:>3}{batch:>5}{ours:>13.2f}{theirs:>10.2f}{ratio:>15.2f}x")
    worst = min(r["speed_vs_torch"] for r in rows)
    print(f"slowest point: {worst:.2f}x torch's speed (target >= 0.7x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
