"""Batching on vs off, measured by Triton's own load generator, perf_analyzer.

Starts ``rnnserve serve`` on ``bench/serve.py``'s repository (one random LSTM served as
``bench``, batching, and ``bench_nobatch``, ``max_batch_size`` 1), writes perf_analyzer's
input data (single sequences with lengths drawn from ``--min-len``..``--max-len``, see
``perf_analyzer_data.py``), and runs perf_analyzer for each protocol and concurrency on both
models, one after another on one server. Prints one table: throughput, p50 and p99 latency,
and perf_analyzer's server-side split (queue, compute; from rnnserve's ``/stats``), with
the batching on / off throughput ratio::

    python bench/perf_analyzer_serve.py --device cuda --frontends 8 [--concurrency 1,64] [--protocols http,grpc]

perf_analyzer comes with the tritonclient wheel; on Linux it needs ``libb64-0d`` (Debian) and
CUDA 12's runtime library (``nvidia-cuda-runtime-cu12``, found here by itself).
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_analyzer_data  # noqa: E402
import serve  # noqa: E402


def run_cell(exe: str, env: dict[str, str], model: str, url: str, protocol: str, concurrency: int,
             data: Path, window_ms: int, out_csv: Path) -> dict[str, float]:
    """One perf_analyzer measurement; its CSV row (latencies in µs) as floats."""
    cmd = [exe, "-m", model, "-u", url, "-i", protocol, "--input-data", str(data),
           "--concurrency-range", str(concurrency), "-p", str(window_ms), "-s", "30", "-r", "10",
           "-f", str(out_csv)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0:
        raise SystemExit(f"perf_analyzer failed ({' '.join(cmd)}):\n{run.stdout}\n{run.stderr}")
    with out_csv.open() as f:
        row = next(csv.DictReader(f))
    return {k: float(v) for k, v in row.items() if v not in ("", None) and k is not None
            and v.replace(".", "", 1).isdigit()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--frontends", type=int, default=1, help="rnnserve serve --frontends (default 1)")
    p.add_argument("--features", type=int, default=40)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 64])
    p.add_argument("--protocols", type=lambda s: s.split(","), default=["http", "grpc"])
    p.add_argument("--window-ms", type=int, default=2000, help="perf_analyzer's measurement window (default 2000)")
    args = p.parse_args(argv)
    exe, env = perf_analyzer_data.perf_analyzer_env()
    work = Path(tempfile.mkdtemp(prefix="rnnserve-pa-"))
    repo = work / "models"
    serve.write_repository(repo, args.features, args.hidden, args.layers)
    proc, http, grpc = serve.start_server(repo, args.device, ["--frontends", str(args.frontends)])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("rnnserve did not become ready")
                time.sleep(0.5)
        data = work / "data.json"
        perf_analyzer_data.main(["--url", http, "--model", "bench", "--count", "64", "--min-len", str(args.min_len),
                                 "--max-len", str(args.max_len), "--out", str(data)])
        print(f"perf_analyzer vs rnnserve: LSTM I={args.features} H={args.hidden} L={args.layers}, lengths "
              f"{args.min_len}..{args.max_len}, device {args.device}, {args.frontends} front-end process(es), "
              f"{os.cpu_count()} CPUs, window {args.window_ms} ms")
        print("| protocol | conc | batching | infer/s | p50 ms | p99 ms | server queue ms | server compute ms | on/off |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for protocol in args.protocols:
            url = http if protocol == "http" else grpc
            for conc in args.concurrency:
                rows = {}
                for model, label in (("bench", "on"), ("bench_nobatch", "off")):
                    rows[label] = r = run_cell(exe, env, model, url, protocol, conc, data, args.window_ms,
                                               work / f"{protocol}_{conc}_{label}.csv")
                    ratio = f"{rows['on']['Inferences/Second'] / r['Inferences/Second']:.1f}x" if label == "off" else ""
                    print(f"| {protocol} | {conc} | {label} | {r['Inferences/Second']:.0f} | "
                          f"{r.get('p50 latency', 0) / 1e3:.2f} | {r.get('p99 latency', 0) / 1e3:.2f} | "
                          f"{r.get('Server Queue', 0) / 1e3:.2f} | {r.get('Server Compute Infer', 0) / 1e3:.2f} | "
                          f"{ratio} |", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
