"""The cuDNN engine alone on ragged many-to-one batches, next to torch.nn.LSTM on the same GPU and batches.

What the scheduler hands the engine under concurrent requests: batches of B sequences with
lengths drawn from --min-len..--max-len, each asking for the output at its own last step.
Per model size (H, layers) and B, three sides on the same batches, in one run:

* ``rnnserve``: the engine as it serves (``engine.launch`` from NumPy, ``wait``, ``finish``);
* a second engine planning as an earlier round did (``--compare``):
  ``replay-lines`` removes the whole-model replay lines that the layout tuning records,
  so the planner weighs calls by the per-block lines, timed batch-major (the 2026-11-29 round);
  ``chunks`` (the default) plans without splitting a padded batch into its longest rows and the rest (as before
  2026-11-30), with everything else as it is;
  ``host-lines`` also removes the autotuner's host lines, which is how it planned ragged batches before
  that round (a ragged batch of a model whose buckets chose STANDARD then ran uncaptured: its per-step
  launches on the host);
* ``torch``: ``torch.nn.LSTM`` (same weights, fp32 without TF32, as the engine) on the batch
  padded to its longest sequence, from host to host (copy in, run, pick each sequence's last
  output, copy out), and on a ``pack_padded_sequence`` of it.

For each: ms per batch (p50, p90; launch to host outputs, one batch at a time), the host ms
``launch`` held the calling thread (the engine process's thread serves every request, so
1000 / that is the batches per second it could launch; torch holds the thread for the whole
call), and the engine's CUDA graph captures and replays. The two engines take turns batch by
batch; the first --warmup batches are not counted (graphs are captured on a shape's second
use). ``--explain`` prints the autotuner's GPU and host lines per bucket and a few batches'
plans and graph shapes.

    python bench/ragged_batches.py [--sizes 128x1,256x2,512x2] [--batches 8,20,32] [--calls 120]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import packed_from_torch  # noqa: E402

from service.engines.cudnn import CudnnEngine  # noqa: E402
from service.engines.cudnn.shape_buckets import GraphShapes  # noqa: E402


def as_before(engine: CudnnEngine, compare: str) -> None:
    """Plan and pad as an earlier round did: without chunks (``chunks``), or without the replay lines, and for
    ``host-lines`` also without the host lines (GPU times only)."""
    if compare == "chunks":
        engine._table.chunks = False
        engine._plans.clear()
        return
    engine._table.replay_lines.clear()
    engine._table.__dict__.pop("_bounds", None)
    if compare == "host-lines":
        for per in engine._table.choices:
            for choice in per:
                for trial in choice.trials.values():
                    trial.host_ms = trial.long_host_ms = None
    engine._table._algos.clear()
    engine._plans.clear()
    engine._shapes = GraphShapes(engine._table, engine._shapes.enabled)


def batches(rng: np.random.Generator, b: int, count: int, lo: int, hi: int, features: int) -> list:
    out = []
    for _ in range(count):
        lengths = rng.integers(lo, hi + 1, b)
        out.append((rng.standard_normal((b, int(lengths.max()), features)).astype(np.float32), lengths))
    return out


def time_engines(engines: list[CudnnEngine], work: list, warmup: int) -> list[tuple[list[float], list[float]]]:
    """Per engine, (ms per batch, host ms of its launch) for each batch after ``warmup``; the engines take
    turns batch by batch, so that neither is measured only in a slow spell of the GPU or the host."""
    out = [([], []) for _ in engines]
    for i, (x, lengths) in enumerate(work):
        # the order flips every batch: the second engine to read a batch finds it in the CPU's cache
        turns = list(zip(engines, out))
        for engine, (total, host) in turns if i % 2 == 0 else turns[::-1]:
            t0 = time.perf_counter()
            launched = engine.launch(x, lengths, states_needed=False, last_only=True)
            t1 = time.perf_counter()
            launched.wait()
            launched.finish()
            t2 = time.perf_counter()
            if i >= warmup:
                total.append((t2 - t0) * 1e3)
                host.append((t1 - t0) * 1e3)
    return out


def explain(engine: CudnnEngine, work: list) -> None:
    """The autotuner's lines per bucket at the longest length, and the plan and graph shape of a few batches."""
    from service.engines.cudnn import library as L
    from service.engines.cudnn.autotune import plan
    from service.engines.cudnn.shape_buckets import pad_budget

    table = engine._table
    print(f"    engine load {engine.load_ms:.0f} ms")
    for k, per in enumerate(table.choices):
        cells = []
        for choice in per:
            algo = choice.algo_at(table.long_steps, table.steps, table.long_steps)
            trial = choice.trials[algo]
            cells.append(f"{choice.bucket}:{L.ALGO_NAMES[algo]} gpu {trial.long_ms or 0:.2f} host "
                         f"{trial.long_host_ms or 0:.2f}")
        print(f"    block {k} at {table.long_steps} steps: " + ", ".join(cells))
    for row in table.describe_layouts():
        line = table.replay_lines.get(row["bucket"])
        print(f"    bucket {row['bucket']}: {row['layout']} ({row.get('timed')}: batch-major "
              f"{row.get('batch_major_ms')}/{row.get('batch_major_long_ms')}, seq-major "
              f"{row.get('seq_major_ms')}/{row.get('seq_major_long_ms')} ms); replay line "
              f"{'-' if line is None else f'{line.time_ms:.3f} / {line.long_ms:.3f} ms'}")
    for x, lengths in work[:4]:
        b, t = x.shape[:2]
        groups = plan(table, b, t, lengths, True)
        kinds = [("padded" if g.uniform else "ragged") + f" {g.n}x{g.steps} {[L.ALGO_NAMES[a] for a in g.algos]}"
                 for g in groups]
        print(f"    batch {b}x{t}: plan {kinds}; graph shape {engine._shapes.padded(b, t)}; "
              f"pad budget {pad_budget(table, b, t):.2f} ms")


def time_torch(mod, work: list, warmup: int, packed: bool) -> list[float]:
    import torch

    total = []
    for i, (x, lengths) in enumerate(work):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        xd = torch.from_numpy(x).cuda(non_blocking=False)
        lens = torch.from_numpy(lengths)
        with torch.inference_mode():
            if packed:
                seq = torch.nn.utils.rnn.pack_padded_sequence(xd, lens, batch_first=True, enforce_sorted=False)
                _, (h_n, _) = mod(seq)
                last = h_n[-1]
            else:
                y, _ = mod(xd)
                last = y[torch.arange(len(lengths), device="cuda"), lens.cuda() - 1]
            last.cpu()
        t1 = time.perf_counter()
        if i >= warmup:
            total.append((t1 - t0) * 1e3)
    return total


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128x1,256x2,512x2", help="HxLAYERS, comma-separated (LSTM, I=40)")
    ap.add_argument("--batches", default="8,20,32", help="sequences per batch")
    ap.add_argument("--calls", type=int, default=120, help="batches per side and size (after --warmup)")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--explain", action="store_true", help="print the autotuner's lines and a few batches' plans")
    ap.add_argument("--compare", choices=("chunks", "replay-lines", "host-lines"), default="chunks",
                    help="what the second engine plans without (see the docstring)")
    args = ap.parse_args()

    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name(0)}  torch {torch.__version__}  lengths {args.min_len}..{args.max_len}, "
          f"many-to-one, LSTM I=40, fp32; {args.calls} batches per cell after {args.warmup} warm-up", flush=True)
    header = (f"| H | layers | B | side | ms/batch p50 | p90 | launch host ms p50 | batches/s (1 thread) "
              f"| vs torch padded | graphs captured / replayed |")
    print(header)
    print("|" + "---|" * 10)
    for size in args.sizes.split(","):
        hidden, layers = (int(v) for v in size.split("x"))
        torch.manual_seed(0)
        mod = torch.nn.LSTM(40, hidden, layers, batch_first=True).eval()
        model = packed_from_torch(mod, "lstm", "float32", [args.max_batch_size])
        mod = mod.cuda()
        for b in (int(v) for v in args.batches.split(",")):
            rng = np.random.default_rng(hidden * 1000 + layers * 100 + b)
            work = batches(rng, b, args.warmup + args.calls, args.min_len, args.max_len, 40)
            engines = [CudnnEngine(model, blocking_sync=True), CudnnEngine(model, blocking_sync=True)]
            try:
                as_before(engines[1], args.compare)
                if args.explain:
                    print(f"  H={hidden} L={layers} B={b}:")
                    explain(engines[0], work)
                    print(f"  H={hidden} L={layers} B={b}, without {args.compare}:")
                    explain(engines[1], work)
                timed = time_engines(engines, work, args.warmup)
                graphs = [e.describe()["cuda_graphs"] or {} for e in engines]
            finally:
                for e in engines:
                    e.close()
            rows = {side: (total, host, f"{g.get('captures', 0)} / {g.get('replays', 0)}")
                    for side, (total, host), g in zip(("rnnserve", f"rnnserve, no {args.compare}"), timed, graphs)}
            rows["torch, padded"] = (time_torch(mod, work, args.warmup, False), [], "")
            rows["torch, packed"] = (time_torch(mod, work, args.warmup, True), [], "")
            base = statistics.median(rows["torch, padded"][0])
            for side, (total, host, graphs) in rows.items():
                med = statistics.median(total)
                per_s = 1e3 / statistics.median(host) if host else 1e3 / med
                print(f"| {hidden} | {layers} | {b} | {side} | {med:.3f} | {p(total, 90):.3f} | "
                      f"{statistics.median(host) if host else float('nan'):.3f} | {per_s:,.0f} | "
                      f"{base / med:.2f}x | {graphs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
