"""Serving benchmark: throughput and latency of rnnserve over HTTP JSON, HTTP binary and gRPC.

By default it writes a temporary repository holding one random LSTM twice, as
``bench`` (dynamic batching: the server's defaults) and ``bench_nobatch``
(``max_batch_size`` 1), starts ``rnnserve serve`` on free ports, and drives both at
each concurrency with sequences whose lengths are drawn from --min-len..--max-len.
Each request asks for ``output_last`` (many-to-one), the common serving case.

    python bench/serve.py                         # default run, about 2 minutes on 2 cores
    python bench/serve.py --out bench/results/serve.json
    python bench/serve.py --url 127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --model kws --no-compare

Client and server share the machine's cores, so numbers on small machines are a
lower bound. The table prints requests/s, sequences/s and p50/p99 latency in ms.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LINE = re.compile(r"rnnserve: HTTP on ([^:\s]+):(\d+), (?:gRPC on ([^:\s]+):(\d+)|gRPC off)")
HEADER = "Inference-Header-Content-Length"


# ---- server ----------------------------------------------------------------------------------------------


def write_repository(repo: Path, features: int, hidden: int, layers: int) -> None:
    """One random LSTM, served as ``bench`` (batching) and ``bench_nobatch`` (max_batch_size 1)."""
    from service.packing import block_param_count
    from service.repository import PackedModel
    from service.spec import BlockSpec, RNNSpec

    spec = RNNSpec((BlockSpec("lstm", features, hidden, num_layers=layers),))
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(block_param_count(spec.blocks[0])) / np.sqrt(hidden)).astype(np.float32)
    model = PackedModel(spec, [weights])
    model.save(repo, "bench", 1)
    model.save(repo, "bench_nobatch", 1)
    (repo / "bench_nobatch" / "config.json").write_text(json.dumps({"max_batch_size": 1}))


def start_server(repo: Path, device: str, extra: list[str]) -> tuple[subprocess.Popen, str, str | None]:
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repo), "--host", "127.0.0.1",
           "--http-port", "0", "--grpc-port", "0", "--device", device, "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = LINE.search(line)
        if m:
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            grpc = f"{m.group(3)}:{m.group(4)}" if m.group(3) else None
            return proc, f"{m.group(1)}:{m.group(2)}", grpc
    raise RuntimeError("rnnserve did not start:\n" + "".join(lines))


async def wait_ready(session, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(f"http://{url}/v2/health/ready") as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"server at {url} did not become ready")


# ---- payloads ----------------------------------------------------------------------------------------------


def make_sequences(n: int, features: int, lo: int, hi: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, int(t), features)).astype(np.float32) for t in rng.integers(lo, hi + 1, n)]


def json_body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}],
                       "outputs": [{"name": "output_last", "parameters": {"binary_data": False}}]}).encode()


def binary_body(x: np.ndarray) -> tuple[bytes, int]:
    head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "output_last", "parameters": {"binary_data": True}}]}).encode()
    return head + x.tobytes(), len(head)


# ---- load ----------------------------------------------------------------------------------------------------


async def run_cell(send, payloads: list, concurrency: int, duration: float, warmup: float) -> dict:
    """``concurrency`` closed-loop workers call ``send(payload)`` for ``duration`` seconds after ``warmup``."""
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + duration

    async def worker(k: int) -> None:
        nonlocal errors
        i = k
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            try:
                await send(payloads[i % len(payloads)])
                ok = True
            except Exception:  # noqa: BLE001 - counted
                ok = False
            t1 = time.perf_counter()
            if t0 >= measure_from:
                if ok:
                    latencies.append(t1 - t0)
                else:
                    errors += 1
            i += concurrency

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    lat = np.asarray(latencies) * 1000
    return {
        "requests": len(latencies), "errors": errors,
        "throughput_rps": len(latencies) / duration,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
    }


def http_sender(session, url: str, model: str, binary: bool):
    path = f"http://{url}/v2/models/{model}/infer"

    async def send(payload) -> None:
        if binary:
            body, n = payload
            headers = {HEADER: str(n), "content-type": "application/octet-stream"}
        else:
            body, headers = payload, {"content-type": "application/json"}
        async with session.post(path, data=body, headers=headers) as r:
            content = await r.read()
            if r.status != 200:
                raise RuntimeError(content[:200])

    return send


def grpc_sender(client, model: str):
    import tritonclient.grpc.aio as tga

    async def send(x: np.ndarray) -> None:
        inp = tga.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        await client.infer(model, [inp], outputs=[tga.InferRequestedOutput("output_last")])

    return send


async def bench(args: argparse.Namespace, http_url: str, grpc_url: str | None, models: list[str]) -> list[dict]:
    # aiohttp, not httpx: httpx's pool costs more CPU than the server at 64 connections on 2 cores.
    import aiohttp

    seqs = make_sequences(args.pool, args.features, args.min_len, args.max_len)
    payloads = {"http-json": [json_body(x) for x in seqs], "http-binary": [binary_body(x) for x in seqs],
                "grpc": seqs}
    rows = []
    connector = aiohttp.TCPConnector(limit=max(args.concurrency) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await wait_ready(session, http_url)
        grpc_client = None
        if "grpc" in args.protocols and grpc_url:
            import tritonclient.grpc.aio as tga

            grpc_client = tga.InferenceServerClient(grpc_url)
        try:
            for protocol in args.protocols:
                if protocol == "grpc" and grpc_client is None:
                    print("skipping gRPC: the server has no gRPC port", file=sys.stderr)
                    continue
                for model in models:
                    for conc in args.concurrency:
                        if protocol == "grpc":
                            send = grpc_sender(grpc_client, model)
                        else:
                            send = http_sender(session, http_url, model, protocol == "http-binary")
                        res = await run_cell(send, payloads[protocol], conc, args.duration, args.warmup)
                        row = {"protocol": protocol, "model": model,
                               "batching": "off" if model.endswith("_nobatch") else "on", "concurrency": conc, **res}
                        rows.append(row)
                        print(_format_row(row), flush=True)
        finally:
            if grpc_client is not None:
                await grpc_client.close()
    return rows


def _format_row(r: dict) -> str:
    p50 = f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "-"
    p99 = f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "-"
    return (f"| {r['protocol']:<11} | {r['batching']:<8} | {r['concurrency']:>4} | {r['throughput_rps']:>9.1f} | "
            f"{p50:>8} | {p99:>8} | {r['errors']:>6} |")


TABLE_HEAD = ("| protocol    | batching | conc |     req/s |  p50 ms  |  p99 ms  | errors |\n"
              "|-------------|----------|-----:|----------:|---------:|---------:|-------:|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="HTTP host:port of a running server (default: start one)")
    p.add_argument("--grpc-url", help="gRPC host:port of that server")
    p.add_argument("--model", default="bench", help="model to drive with --url (default bench)")
    p.add_argument("--no-compare", action="store_true", help="with --url: skip the <model>_nobatch comparison")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="device of the started server")
    p.add_argument("--features", type=int, default=40, help="input features I (default 40)")
    p.add_argument("--hidden", type=int, default=128, help="LSTM hidden size H (default 128)")
    p.add_argument("--layers", type=int, default=1, help="LSTM layers (default 1)")
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 64])
    p.add_argument("--protocols", type=lambda s: s.split(","), default=["http-json", "http-binary", "grpc"])
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per cell (default 3)")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds per cell (default 0.5)")
    p.add_argument("--pool", type=int, default=64, help="distinct pre-built requests (default 64)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)

    proc = None
    tmp = None
    if args.url:
        http_url, grpc_url = args.url, args.grpc_url
        models = [args.model] if args.no_compare else [args.model, f"{args.model}_nobatch"]
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rnnserve-bench-")
        repo = Path(tmp.name) / "models"
        write_repository(repo, args.features, args.hidden, args.layers)
        proc, http_url, grpc_url = start_server(repo, args.device, [])
        models = ["bench", "bench_nobatch"]
    print(f"rnnserve bench: LSTM I={args.features} H={args.hidden} L={args.layers}, lengths "
          f"{args.min_len}..{args.max_len}, output_last, {args.duration:.0f}s per cell, "
          f"{os.cpu_count()} CPUs, server {http_url} (gRPC {grpc_url or 'off'})")
    print(TABLE_HEAD, flush=True)
    try:
        rows = asyncio.run(bench(args, http_url, grpc_url, models))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if tmp is not None:
            tmp.cleanup()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "model": {"cell": "lstm", "features": args.features, "hidden": args.hidden, "layers": args.layers},
            "lengths": [args.min_len, args.max_len], "duration_s": args.duration, "device": args.device,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "results": rows,
        }, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
