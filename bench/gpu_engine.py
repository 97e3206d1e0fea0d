"""Benchmark: the rnnserve cuDNN engine against torch.nn.LSTM/GRU on the same GPU and inputs.

Two ways of calling each: host-in/host-out (NumPy in, NumPy out, what a server
does) and device-to-device (CuPy/torch tensors already on the GPU). Each time is the
best of 3 rounds (the four measurements alternate within a round) of the median of N
calls, each call timed with perf_counter after synchronizing, after warm-up calls. PyTorch runs with ``torch.backends.cudnn.allow_tf32 = False`` so both
sides compute exact fp32 (the engine's default FMA math); fp16 runs both in fp16.

    python3 bench/gpu_engine.py --out results.json [--quick]

Prints one table and writes every measurement, the engine's chosen algorithms and
the targets' verdicts to the JSON file. The algorithm column reads
``algorithm/io`` (the first block's algorithm for this batch at T, from the autotuner's cost lines): io ``bm`` = batch-major cuDNN IO, ``sm`` = sequence-major (one input
transpose, output returned as a transposed view, like torch's batch_first).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.engines.cudnn import CudnnEngine  # noqa: E402
from service.packing import LayerWeights, pack_block  # noqa: E402
from service.repository import ModelConfig, PackedModel  # noqa: E402
from service.spec import BlockSpec, RNNSpec  # noqa: E402


def packed_from_torch(mod, cell: str, precision: str, batches) -> PackedModel:
    sd = {k: v.detach().double().cpu().numpy() for k, v in mod.state_dict().items()}
    layers = []
    for layer in range(mod.num_layers):
        s = f"_l{layer}"
        layers.append(LayerWeights(sd["weight_ih" + s], sd["weight_hh" + s], sd["bias_ih" + s], sd["bias_hh" + s]))
    spec = BlockSpec(cell, mod.input_size, mod.hidden_size, mod.num_layers)
    cfg = ModelConfig(precision=precision, max_batch_size=max(batches))
    return PackedModel(RNNSpec((spec,)), [pack_block(spec, layers)], config=cfg, name=f"{cell}{mod.hidden_size}")


def measure(fn, sync, budget_s: float, min_iters: int = 5, max_iters: int = 60) -> float:
    """Median ms of fn() + sync() after warm-ups; the number of calls fits ``budget_s``."""
    for _ in range(3):
        fn()
        sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    iters = int(min(max_iters, max(min_iters, budget_s / max(first, 1e-6))))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def best_of_rounds(sides: dict, budget_s: float, rounds: int) -> dict[str, float]:
    """Each side's best median over ``rounds`` rounds that alternate the sides.

    The GPU's clocks and the host's load drift over seconds; alternating the sides and
    keeping each one's best round lets neither side be measured only in a slow spell.
    """
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):
        for name, (fn, sync) in sides.items():
            best[name] = min(best[name], measure(fn, sync, budget_s / rounds))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of the JSON results file")
    ap.add_argument("--quick", action="store_true", help="a few grid points only (smoke test)")
    ap.add_argument("--steps", type=int, default=100, help="sequence length T")
    ap.add_argument("--budget", type=float, default=0.12, help="seconds of timed calls per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per measurement; best median kept")
    args = ap.parse_args()

    import cupy as cp
    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    cells = ["lstm", "gru"]
    hiddens = [128, 512, 1024]
    layer_counts = [1, 2]
    batches = [1, 8, 64, 256]
    dtypes = ["float32", "float16"]
    if args.quick:
        cells, hiddens, batches = ["lstm"], [512], [1, 256]
    t = args.steps
    gpu = torch.cuda.get_device_name(0)
    print(f"GPU: {gpu}  torch {torch.__version__}  cuDNN (torch) {torch.backends.cudnn.version()}  T={t}", flush=True)
    rows, engines = [], []
    started = time.perf_counter()
    for dtype in dtypes:
        tdt = getattr(torch, dtype)
        for cell in cells:
            for hidden in hiddens:
                for layers in layer_counts:
                    torch.manual_seed(0)
                    cls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
                    mod = cls(hidden, hidden, layers, batch_first=True).eval()
                    model = packed_from_torch(mod, cell, dtype, batches)
                    mod = mod.to("cuda", tdt)
                    try:
                        eng = CudnnEngine(model, buckets=tuple(batches))
                    except Exception as exc:  # report and go on with the grid
                        print(f"  {cell} H={hidden} L={layers} {dtype}: engine failed: {exc}", flush=True)
                        continue
                    info = eng.describe()
                    layouts = {c["bucket"]: "sm" if c["layout"] == "seq_major" else "bm" for c in info["layouts"]}
                    engines.append({"cell": cell, "hidden": hidden, "layers": layers, "dtype": dtype,
                                    "load_ms": info["load_ms"], "algorithms": info["algorithms"],
                                    "layouts": info["layouts"]})
                    for batch in batches:
                        rng = np.random.default_rng(batch)
                        x_host = rng.standard_normal((batch, t, hidden)).astype(np.float32).astype(dtype)
                        x_cp = cp.asarray(x_host)
                        x_t = torch.from_numpy(x_host).to("cuda")
                        rec = {"cell": cell, "hidden": hidden, "layers": layers, "batch": batch, "dtype": dtype,
                               "algo": f"{eng.algorithms_for(batch, t)[0]}/{layouts.get(batch)}"}
                        with torch.no_grad():
                            def torch_host():
                                y, _ = mod(torch.from_numpy(x_host).to("cuda"))
                                return y.cpu().numpy()

                            def torch_dev():
                                return mod(x_t)

                            sync_t = torch.cuda.synchronize
                            sides = {"torch_host_ms": (torch_host, sync_t),
                                     "rnnserve_host_ms": (lambda: eng.forward(x_host), lambda: None),
                                     "torch_dev_ms": (torch_dev, sync_t),
                                     "rnnserve_dev_ms": (lambda: eng.forward(x_cp, output_device="device"),
                                                         eng.synchronize)}
                            rec.update(best_of_rounds(sides, args.budget, args.rounds))
                        rec["speedup_host"] = rec["torch_host_ms"] / rec["rnnserve_host_ms"]
                        rec["speedup_dev"] = rec["torch_dev_ms"] / rec["rnnserve_dev_ms"]
                        rows.append(rec)
                        print(f"  {dtype:8s} {cell:4s} H={hidden:<5d} L={layers} B={batch:<4d} "
                              f"{rec['algo']:>25s}  host torch {rec['torch_host_ms']:8.3f} ms ours "
                              f"{rec['rnnserve_host_ms']:8.3f} ms x{rec['speedup_host']:5.2f} | dev torch "
                              f"{rec['torch_dev_ms']:8.3f} ms ours {rec['rnnserve_dev_ms']:8.3f} ms "
                              f"x{rec['speedup_dev']:5.2f}", flush=True)
                        del x_cp, x_t
                    eng.close()
                    del mod
    elapsed = time.perf_counter() - started

    # fp16 engine vs torch fp32 at the largest batch
    fp32 = {(r["cell"], r["hidden"], r["layers"], r["batch"]): r for r in rows if r["dtype"] == "float32"}
    mixed = []
    for r in rows:
        if r["dtype"] == "float16" and r["batch"] == max(batches):
            ref = fp32.get((r["cell"], r["hidden"], r["layers"], r["batch"]))
            if ref:
                mixed.append({"cell": r["cell"], "hidden": r["hidden"], "layers": r["layers"], "batch": r["batch"],
                              "torch_fp32_dev_ms": ref["torch_dev_ms"], "rnnserve_fp16_dev_ms": r["rnnserve_dev_ms"],
                              "ratio_dev": ref["torch_dev_ms"] / r["rnnserve_dev_ms"],
                              "torch_fp32_host_ms": ref["torch_host_ms"], "rnnserve_fp16_host_ms": r["rnnserve_host_ms"],
                              "ratio_host": ref["torch_host_ms"] / r["rnnserve_host_ms"]})

    print()
    print(f"GPU: {gpu}; T={t}; median ms per call; speedup = torch / rnnserve")
    head = (f"{'dtype':8s} {'cell':4s} {'H':>5s} {'L':>2s} {'B':>4s} {'algorithm/io':>25s} | {'torch':>8s} "
            f"{'rnnserve':>8s} {'x':>6s} (host) | {'torch':>8s} {'rnnserve':>8s} {'x':>6s} (device)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['dtype']:8s} {r['cell']:4s} {r['hidden']:5d} {r['layers']:2d} {r['batch']:4d} "
              f"{r['algo']:>25s} | {r['torch_host_ms']:8.3f} {r['rnnserve_host_ms']:8.3f} "
              f"{r['speedup_host']:6.2f}        | {r['torch_dev_ms']:8.3f} {r['rnnserve_dev_ms']:8.3f} "
              f"{r['speedup_dev']:6.2f}")
    print()
    print("fp16 rnnserve vs fp32 torch at B=%d:" % max(batches))
    for m in mixed:
        print(f"  {m['cell']:4s} H={m['hidden']:<5d} L={m['layers']}  device x{m['ratio_dev']:.2f}  "
              f"host x{m['ratio_host']:.2f}")

    targets = {}
    b1 = [r for r in rows if r["cell"] == "lstm" and r["hidden"] == 512 and r["layers"] == 2 and r["batch"] == 1
          and r["dtype"] == "float32"]
    if b1:
        targets["lstm_h512_l2_b1_fp32_5x"] = {"speedup_dev": b1[0]["speedup_dev"], "speedup_host": b1[0]["speedup_host"],
                                              "met": min(b1[0]["speedup_dev"], b1[0]["speedup_host"]) >= 5.0}
    slow = [r for r in rows if min(r["speedup_host"], r["speedup_dev"]) < 0.98]
    targets["no_point_slower_than_torch"] = {
        "met": not slow, "slower": [{k: r[k] for k in ("dtype", "cell", "hidden", "layers", "batch", "speedup_host",
                                                      "speedup_dev")} for r in slow]}
    if mixed:
        worst = min(min(m["ratio_dev"], m["ratio_host"]) for m in mixed)
        targets["fp16_b256_vs_torch_fp32_1.3x"] = {"worst": worst, "met": worst >= 1.3}
    print()
    for name, verdict in targets.items():
        print(f"target {name}: {'MET' if verdict['met'] else 'MISSED'} "
              f"{ {k: v for k, v in verdict.items() if k != 'met'} }")
    print(f"benchmark took {elapsed:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "gpu": gpu, "torch": torch.__version__, "steps": t, "rows": rows, "fp16_vs_torch_fp32": mixed,
        "targets": targets, "engines": engines, "elapsed_s": elapsed,
    }, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
