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
lower bound. The table prints requests/s, p50/p99 latency in ms, and from the server's
/metrics the average batch (sequences per engine call) and how busy the engine was.
The default client (``--client lean``) sends pre-encoded requests on raw keep-alive
HTTP connections or a raw gRPC channel and parses each answer, so that the numbers are
the server's; ``--client standard`` drives aiohttp and tritonclient.grpc.aio instead.
Its grpc runs with rnnserve's grpc core settings (``service/transports/grpc/core_config.py``)
unless ``GRPC_EXPERIMENTS`` is set: ``GRPC_EXPERIMENTS= python bench/serve.py`` gives client and
started server grpc's defaults.

The ``streams`` scenario (in the default run; alone with ``--scenario streams``)
serves a second LSTM, ``bench_stream`` (2 layers, H=256 by default, max_batch_size
256), and drives N concurrent streams (N in --streams, default 1,16,256) over gRPC,
each sending --chunk-steps chunks (default 10 steps) one after another: first as
stateful streams (sequence_id/start/end, the server keeps h and c), then the same
chunks statelessly (the client sends h_0/c_0 and reads back h_n/c_n). It prints
chunks/s and p50/p99 chunk latency for both, twice: closed loop (each stream sends its
next chunk when the answer arrives: the server's saturation) and paced like live
sources (--chunk-interval-ms, default one chunk per stream every 100 ms, which is real
time for 10 ms frames). Streams are split over --clients load-generating processes,
which send raw gRPC calls with Triton's sequence parameters (--client lean) or use
tritonclient.grpc.aio (--client standard).
From the server's /metrics, each streams row also shows "server ms" (mean time a chunk
spent in the engine process, queue included: the rest of p50 is the client, gRPC and
front-ends), "avg batch" (chunks per engine batch) and "batch ms" (engine time per batch).
Closed-loop cells send --stream-chunks chunks in all (default 2000 on cuda, 600 on cpu,
shared over the N streams); paced cells run --paced-seconds.

    python bench/serve.py --scenario streams --device cuda    # the GPU target: 256 streams, p99 < 10 ms
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import statistics
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
from procstat import CpuSampler, HostSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The load generator's grpc runs with the server's core settings (GRPC_EXPERIMENTS unless set; set it
# empty for grpc's defaults in both, as the started server inherits it). Imported before any grpc.
import service.transports.grpc.core_config  # noqa: E402,F401

LINE = re.compile(r"rnnserve: HTTP on ([^:\s]+):(\d+), (?:gRPC on ([^:\s]+):(\d{1,5})(?!\d)|gRPC off)")
HEADER = "Inference-Header-Content-Length"
# What the started server printed after its start line (warnings: --log-level warning).
SERVER_LOG: list[str] = []


# ---- server ----------------------------------------------------------------------------------------------


def write_stream_model(repo: Path, features: int, hidden: int, layers: int, extra: dict | None = None) -> None:
    """The streaming scenario's LSTM, ``bench_stream``: batches up to 256 chunks (``extra``: more config)."""
    from service.packing import block_param_count
    from service.repository import PackedModel
    from service.spec import BlockSpec, RNNSpec

    spec = RNNSpec((BlockSpec("lstm", features, hidden, num_layers=layers),))
    rng = np.random.default_rng(2)
    weights = (rng.standard_normal(block_param_count(spec.blocks[0])) / np.sqrt(hidden)).astype(np.float32)
    PackedModel(spec, [weights]).save(repo, "bench_stream", 1)
    (repo / "bench_stream" / "config.json").write_text(
        json.dumps({"max_batch_size": 256, "max_streams": 4096, **(extra or {})}))


def write_repository(repo: Path, features: int, hidden: int, layers: int, extra: dict | None = None) -> None:
    """One random LSTM, served as ``bench`` (batching) and ``bench_nobatch`` (max_batch_size 1); ``extra``:
    config for both."""
    from service.packing import block_param_count
    from service.repository import PackedModel
    from service.spec import BlockSpec, RNNSpec

    spec = RNNSpec((BlockSpec("lstm", features, hidden, num_layers=layers),))
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(block_param_count(spec.blocks[0])) / np.sqrt(hidden)).astype(np.float32)
    model = PackedModel(spec, [weights])
    model.save(repo, "bench", 1)
    model.save(repo, "bench_nobatch", 1)
    (repo / "bench" / "config.json").write_text(json.dumps(extra or {}))
    (repo / "bench_nobatch" / "config.json").write_text(json.dumps({"max_batch_size": 1, **(extra or {})}))


def start_server(repo: Path, device: str, extra: list[str], cpus: list[int] | None = None,
                 grpc_experiments: str | None = None, log_level: str = "warning"
                 ) -> tuple[subprocess.Popen, str, str | None]:
    """``rnnserve serve`` on free ports; ``grpc_experiments``: the server's GRPC_EXPERIMENTS (None: this one's)."""
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repo), "--host", "127.0.0.1",
           "--http-port", "0", "--grpc-port", "0", "--device", device, "--log-level", log_level, *extra]
    env = None if grpc_experiments is None else {**os.environ, "GRPC_EXPERIMENTS": grpc_experiments}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=(lambda: pin(cpus)) if cpus else None)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = LINE.search(line)
        if m:
            import threading

            threading.Thread(target=lambda: SERVER_LOG.extend(proc.stdout), daemon=True).start()
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
    latencies, errors = await run_cell_raw(send, payloads, concurrency, duration, warmup)
    return _summary(latencies, errors, duration)


class _Window:
    """A cell's clock and tally: ``warmup`` unmeasured seconds, then ``duration`` measured ones.

    Workers call :meth:`record` after each call they started; only calls started in the measured
    window count. Safe from threads: ``list.append`` is atomic in CPython."""

    def __init__(self, duration: float, warmup: float) -> None:
        self.measure_from = time.perf_counter() + warmup
        self.stop_at = self.measure_from + duration
        self.latencies: list[float] = []
        self.failed: list[float] = []

    def record(self, t0: float, ok: bool) -> None:
        if t0 >= self.measure_from:
            (self.latencies if ok else self.failed).append(time.perf_counter() - t0)

    def meter_times(self) -> tuple[float, float]:
        """(seconds until the measured window starts, its length)."""
        return max(0.0, self.measure_from - time.perf_counter()), self.stop_at - self.measure_from

    def result(self) -> tuple[list[float], int]:
        return self.latencies, len(self.failed)


async def run_cell_raw(send, payloads: list, concurrency: int, duration: float,
                       warmup: float, meter: dict | None = None) -> tuple[list[float], int]:
    """``concurrency`` closed-loop workers call ``send(payload)`` for ``duration`` seconds after ``warmup``.

    ``meter``: gets this process's CPU seconds over the measured window (``cpu_s``) and the window's
    wall-clock start and end (``time.time()``, for :class:`procstat.CpuSampler`)."""
    window = _Window(duration, warmup)

    async def metered() -> None:
        wait, length = window.meter_times()
        await asyncio.sleep(wait)
        cpu0, wall0 = time.process_time(), time.time()
        await asyncio.sleep(length)
        meter.update(cpu_s=time.process_time() - cpu0, start=wall0, end=time.time())

    async def worker(k: int) -> None:
        i = k
        while (t0 := time.perf_counter()) < window.stop_at:
            try:
                await send(payloads[i % len(payloads)], k)
                window.record(t0, True)
            except Exception:  # noqa: BLE001 - counted
                window.record(t0, False)
            i += concurrency

    await asyncio.gather(*(worker(k) for k in range(concurrency)), *([metered()] if meter is not None else []))
    return window.result()


def run_cell_threads(send, payloads: list, concurrency: int, duration: float,
                     warmup: float, meter: dict | None = None) -> tuple[list[float], int]:
    """:func:`run_cell_raw` for a blocking ``send(payload, worker)``: one thread per closed-loop worker.

    A blocking gRPC client (tritonclient.grpc, grpc's sync stubs) waits for its answer on the calling
    thread; grpc.aio hands every answer from its poller thread to the event loop, one thread wake-up
    more per call on the client's side of each measured latency."""
    import threading

    window = _Window(duration, warmup)

    def worker(k: int) -> None:
        i = k
        while (t0 := time.perf_counter()) < window.stop_at:
            try:
                send(payloads[i % len(payloads)], k)
                window.record(t0, True)
            except Exception:  # noqa: BLE001 - counted
                window.record(t0, False)
            i += concurrency

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    if meter is not None:
        wait, length = window.meter_times()
        time.sleep(wait)
        cpu0, wall0 = time.process_time(), time.time()
        time.sleep(length)
        meter.update(cpu_s=time.process_time() - cpu0, start=wall0, end=time.time())
    for t in threads:
        t.join()
    return window.result()


def http_sender(session, url: str, model: str, binary: bool):
    """aiohttp (--client standard)."""
    path = f"http://{url}/v2/models/{model}/infer"

    async def send(payload, worker: int) -> None:
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
    """tritonclient.grpc.aio (--client standard)."""
    import tritonclient.grpc.aio as tga

    async def send(x: np.ndarray, worker: int) -> None:
        inp = tga.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        await client.infer(model, [inp], outputs=[tga.InferRequestedOutput("output_last")])

    return send


class RawHTTP:
    """A minimal keep-alive HTTP/1.1 client on one connection: pre-built request bytes in, body out.

    The load generator's own cost per request is part of every latency it reports and, on a
    machine it shares with the server, takes cores from it; aiohttp spends ~150 µs a request
    building and parsing, this a few µs. Responses are still read whole and checked.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def request(self, raw: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
        body = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        return status, headers, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One POST request as bytes, ready to write on a keep-alive connection."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {url}", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def lean_http_sender(url: str, model: str, binary: bool):
    """Closed-loop sender over RawHTTP connections (one per worker); checks each answer."""
    host, port = url.rsplit(":", 1)
    path = f"/v2/models/{model}/infer"
    conns: dict[int, RawHTTP] = {}

    def prepare(payload) -> bytes:
        if binary:
            body, n = payload
            return raw_post(url, path, body, {HEADER: str(n), "Content-Type": "application/octet-stream"})
        return raw_post(url, path, payload, {"Content-Type": "application/json"})

    async def send(raw: bytes, worker: int) -> None:
        conn = conns.get(worker)
        if conn is None:
            conn = conns[worker] = RawHTTP(host, int(port))
        status, headers, body = await conn.request(raw)
        if status != 200:
            raise RuntimeError(body[:200])
        n = int(headers.get(HEADER.lower().encode(), b"0") or 0)
        doc = json.loads(body[:n] if n else body)
        if n:
            np.frombuffer(body[n:], dtype=np.float32)
        elif not doc.get("outputs"):
            raise RuntimeError("no outputs in the answer")

    return prepare, send


def lean_grpc_sender(client_channel, model: str):
    """Closed-loop ModelInfer with pre-serialized requests (raw_input_contents); parses each answer."""
    from service.transports.grpc.generated import inference_pb2 as pb

    call = client_channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    async def send(raw: bytes, worker: int) -> None:
        resp = pb.ModelInferResponse.FromString(await call(raw))
        np.frombuffer(resp.raw_output_contents[0], dtype=np.float32)

    return partial(model_infer_bytes, model), send


def model_infer_bytes(model: str, x: np.ndarray) -> bytes:
    """A serialized ModelInferRequest of ``x`` as raw_input_contents, asking for output_last."""
    from service.transports.grpc.generated import inference_pb2 as pb

    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.outputs.add(name="output_last")
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


def lean_grpc_sync_sender(channels: list, model: str):
    """:func:`lean_grpc_sender` over grpc's blocking stubs (--protocols grpc-sync); worker k uses channel k mod n."""
    from service.transports.grpc.generated import inference_pb2 as pb

    calls = [ch.unary_unary("/inference.GRPCInferenceService/ModelInfer") for ch in channels]

    def send(raw: bytes, worker: int) -> None:
        resp = pb.ModelInferResponse.FromString(calls[worker % len(calls)](raw))
        np.frombuffer(resp.raw_output_contents[0], dtype=np.float32)

    return partial(model_infer_bytes, model), send


def standard_grpc_sync_sender(grpc_url: str, model: str):
    """tritonclient.grpc (blocking), one client per worker (--client standard, --protocols grpc-sync)."""
    import tritonclient.grpc as tg

    clients: dict[int, tg.InferenceServerClient] = {}

    def send(x: np.ndarray, worker: int) -> None:
        client = clients.get(worker) or clients.setdefault(worker, tg.InferenceServerClient(grpc_url))
        inp = tg.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer(model, [inp], outputs=[tg.InferRequestedOutput("output_last")])

    return send, clients


def engine_alone_ms(repo: Path, device: str, seqs: list[np.ndarray], repeats: int = 5,
                    idle_s: float = 1e-3) -> tuple[float, float]:
    """Median time of the engine itself on each single request's sequence, in this process:
    back to back, and each call after ``idle_s`` of idling (as requests at concurrency 1 reach it).

    The service's own cost at concurrency 1 is the request's p50 latency minus this. An engine
    called after an idle gap is slower than in a tight loop (a GPU's clocks and queues, the
    CPU's wake-up: 0.43-0.49 vs 0.24 ms on an H100 host, bench/wait_path.py), and requests at
    concurrency 1 always arrive after one; both are shown.
    """
    from service import create_engine
    from service.repository import load_model

    engine = create_engine(load_model(repo / "bench"), device)
    times, paced = [], []
    for x in seqs:
        engine.forward(x)
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(x)
            times.append(time.perf_counter() - t0)
        for _ in range(repeats):
            time.sleep(idle_s)
            t0 = time.perf_counter()
            engine.forward(x)
            paced.append(time.perf_counter() - t0)
    engine.close()
    return float(np.median(times)) * 1e3, float(np.median(paced)) * 1e3


def _summary(latencies: list[float], errors: int, duration: float) -> dict:
    lat = np.asarray(latencies) * 1000
    return {
        "requests": len(latencies), "errors": errors,
        "throughput_rps": len(latencies) / duration,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
    }


async def _client_cell(cell: dict, meter: dict | None = None) -> tuple[list[float], int]:
    """One load-generating process's share of a cell: (latencies in s, errors); ``meter`` as in run_cell_raw."""
    seqs = make_sequences(cell["pool"], cell["features"], cell["min_len"], cell["max_len"], seed=cell["seed"])
    protocol = cell["protocol"]
    payloads = {"http-json": lambda: [json_body(x) for x in seqs], "http-binary": lambda: [binary_body(x) for x in seqs],
                "grpc": lambda: seqs, "grpc-sync": lambda: seqs}[protocol]()
    run = (cell["concurrency"], cell["duration"], cell["warmup"], meter)
    if protocol == "grpc-sync":
        return await asyncio.to_thread(_grpc_sync_cell, cell, payloads, run)
    if cell["client"] == "lean":
        if protocol == "grpc":
            import grpc

            channels = [grpc.aio.insecure_channel(cell["grpc_url"], options=OWN_CONNECTION)
                        for _ in range(grpc_connections(cell["concurrency"], cell["calls_per_connection"]))]
            try:
                senders = [lean_grpc_sender(ch, cell["model"]) for ch in channels]

                async def send(raw: bytes, worker: int) -> None:  # each worker keeps to one connection
                    await senders[worker % len(senders)][1](raw, worker)

                return await run_cell_raw(send, [senders[0][0](p) for p in payloads], *run)
            finally:
                for ch in channels:
                    await ch.close()
        prepare, send = lean_http_sender(cell["http_url"], cell["model"], protocol == "http-binary")
        return await run_cell_raw(send, [prepare(p) for p in payloads], *run)
    import aiohttp

    connector = aiohttp.TCPConnector(limit=cell["concurrency"] + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        if protocol == "grpc":
            import tritonclient.grpc.aio as tga

            client = tga.InferenceServerClient(cell["grpc_url"])
            try:
                return await run_cell_raw(grpc_sender(client, cell["model"]), payloads, *run)
            finally:
                await client.close()
        send = http_sender(session, cell["http_url"], cell["model"], protocol == "http-binary")
        return await run_cell_raw(send, payloads, *run)


def _grpc_sync_cell(cell: dict, payloads: list, run: tuple) -> tuple[list[float], int]:
    """A grpc-sync cell on worker threads (see :func:`run_cell_threads`)."""
    import grpc

    if cell["client"] != "lean":
        send, clients = standard_grpc_sync_sender(cell["grpc_url"], cell["model"])
        try:
            return run_cell_threads(send, payloads, *run)
        finally:
            for client in clients.values():
                client.close()
    channels = [grpc.insecure_channel(cell["grpc_url"], options=OWN_CONNECTION)
                for _ in range(grpc_connections(cell["concurrency"], cell["calls_per_connection"]))]
    try:
        prepare, send = lean_grpc_sync_sender(channels, cell["model"])
        return run_cell_threads(send, [prepare(p) for p in payloads], *run)
    finally:
        for ch in channels:
            ch.close()


# gRPC channels of one process to one target share a connection unless told otherwise; the clients of
# a real service come over many connections, which the front-end processes' SO_REUSEPORT spreads.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
CALLS_PER_CONNECTION = 4


def grpc_connections(concurrent_calls: int, per_connection: int = CALLS_PER_CONNECTION) -> int:
    """gRPC connections a client process opens for ``concurrent_calls`` calls (or streams) at once."""
    return max(1, -(-concurrent_calls // per_connection))


# Client processes hand the GIL between their event loop and gRPC's poller thread on every answer;
# Python's 5 ms default switch interval would add up to 5 ms to a measured latency (as in the server).
CLIENT_SWITCH_INTERVAL_S = 50e-6


def cpu_list(text: str) -> list[int]:
    """``"0-9,12"`` -> [0, ..., 9, 12] (taskset's list syntax)."""
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin(cpus: list[int] | None) -> None:
    """Run this process (and what it starts) on ``cpus`` only (--client-cpus / --server-cpus)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def run_loop(main):
    """``main`` on uvloop where installed (as the server runs), else asyncio's loop: a load-generating
    process spends less of its own time per request, which the latencies would otherwise include."""
    from service.eventloop import run

    return run(main)


def _client_process(cell: dict) -> tuple[list[float], int, dict]:
    import gc

    sys.setswitchinterval(CLIENT_SWITCH_INTERVAL_S)
    cell = dict(cell)
    pin(cell.pop("cpus", None))
    if cell.pop("gc_off", False):  # see --client-gc
        gc.collect()
        gc.disable()
    meter: dict = {}
    try:
        return (*run_loop(_client_cell(cell, meter)), meter)
    finally:
        gc.enable()


def run_distributed(cell: dict, clients: int) -> dict:
    """Run a cell from ``clients`` processes (concurrency split between them), so that the
    Python client is not what limits the measurement on a machine with cores to spare."""
    import multiprocessing as mp

    clients = max(1, min(clients, cell["concurrency"]))
    shares = [cell["concurrency"] // clients + (1 if k < cell["concurrency"] % clients else 0) for k in range(clients)]
    cells = [{**cell, "concurrency": n, "seed": cell["seed"] + k} for k, n in enumerate(shares)]
    if clients == 1:
        results = [_client_process(cells[0])]
    else:
        with mp.get_context("spawn").Pool(clients) as pool:
            results = pool.map(_client_process, cells)
    latencies = [lat for lats, _, _ in results for lat in lats]
    meters = [m for _, _, m in results if m]
    summary = _summary(latencies, sum(e for _, e, _ in results), cell["duration"])
    if meters:
        summary["client_cores"] = sum(m["cpu_s"] for m in meters) / cell["duration"]
        summary["window"] = (max(m["start"] for m in meters), min(m["end"] for m in meters))
    return summary


_SERVER_SERIES = ("rnnserve_batch_size_count", "rnnserve_batch_size_sum", "rnnserve_compute_duration_seconds_sum",
                  "rnnserve_request_duration_seconds_sum", "rnnserve_request_duration_seconds_count",
                  "rnnserve_queue_duration_seconds_sum", "rnnserve_queue_duration_seconds_count")


def server_counters(http_url: str, model: str) -> dict[str, float]:
    """The server's running totals for ``model`` (batches, sequences, compute and request seconds) from /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{http_url}/metrics", timeout=10).read().decode()
    values = {}
    for name in _SERVER_SERIES:
        total = 0.0
        for m in re.finditer(rf'^{name}{{[^}}]*model="{re.escape(model)}"[^}}]*}} (\S+)$', text, re.M):
            total += float(m.group(1))
        values[name] = total
    # requests answered within 10 ms inside the engine process (histogram bucket le=0.01)
    values["fast"] = sum(float(m.group(1)) for m in re.finditer(
        rf'^rnnserve_request_duration_seconds_bucket{{(?=[^}}]*le="0\.01")(?=[^}}]*model="{re.escape(model)}")[^}}]*}} (\S+)$',
        text, re.M))
    return values


def server_batches(http_url: str, model: str) -> tuple[float, float, float]:
    """(batches, sequences, compute seconds) the server has run for ``model``, from its /metrics."""
    v = server_counters(http_url, model)
    return (v["rnnserve_batch_size_count"], v["rnnserve_batch_size_sum"], v["rnnserve_compute_duration_seconds_sum"])


def server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the engine process saw between two :func:`server_counters` readings: mean time of a request
    inside it (validation to answer, queue included), mean batch size and mean engine time per batch."""
    d = {k: after[k] - before[k] for k in (*_SERVER_SERIES, "fast")}
    batches, requests = d["rnnserve_batch_size_count"], d["rnnserve_request_duration_seconds_count"]
    return {"server_ms": 1e3 * d["rnnserve_request_duration_seconds_sum"] / requests if requests else None,
            "avg_batch": d["rnnserve_batch_size_sum"] / batches if batches else None,
            "batch_ms": 1e3 * d["rnnserve_compute_duration_seconds_sum"] / batches if batches else None,
            "server_slow": int(requests - d["fast"]),
            "queue_ms": (1e3 * d["rnnserve_queue_duration_seconds_sum"] / d["rnnserve_queue_duration_seconds_count"]
                         if d["rnnserve_queue_duration_seconds_count"] else None)}


async def bench(args: argparse.Namespace, http_url: str, grpc_url: str | None, models: list[str]) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await wait_ready(session, http_url)
    rows = []
    for round_ in range(1, args.repeat + 1):
        for protocol in args.protocols:
            if protocol.startswith("grpc") and not grpc_url:
                print("skipping gRPC: the server has no gRPC port", file=sys.stderr)
                continue
            for model in models:
                for conc in args.concurrency:
                    cell = {"protocol": protocol, "model": model, "concurrency": conc, "http_url": http_url,
                            "grpc_url": grpc_url, "pool": args.pool, "features": args.features, "min_len": args.min_len,
                            "max_len": args.max_len, "seed": 1, "duration": args.duration, "warmup": args.warmup,
                            "client": args.client, "gc_off": args.client_gc == "off", "cpus": args.client_cpus,
                            "calls_per_connection": args.grpc_calls_per_connection}
                    before = server_counters(http_url, model)
                    with CpuSampler(args.server_pid or 0) as sampler:
                        res = await asyncio.to_thread(run_distributed, cell, args.clients)
                    after = server_counters(http_url, model)
                    side = server_side(before, after)
                    batches = after["rnnserve_batch_size_count"] - before["rnnserve_batch_size_count"]
                    compute = after["rnnserve_compute_duration_seconds_sum"] - before["rnnserve_compute_duration_seconds_sum"]
                    res["server_batches"] = batches
                    res.update(side)
                    res["compute_ms_per_batch"] = side["batch_ms"]
                    res["engine_busy"] = compute / (args.duration + args.warmup)
                    cores = sampler.cores(*res["window"]) if "window" in res else None
                    res["engine_cores"], res["engine_main_cores"], res["frontend_cores"] = cores or (None, None, None)
                    row = {"protocol": protocol, "model": model, "batching": "off" if model.endswith("_nobatch") else "on",
                           "concurrency": conc, "clients": min(args.clients, conc), **res,
                           "engine_ms": args.engine_ms if conc == 1 else None,
                           "engine_paced_ms": args.engine_paced_ms if conc == 1 else None, "round": round_}
                    rows.append(row)
                    print(_format_row(row), flush=True)
    if args.repeat > 1 or len(models) > 1:
        print(summary(rows))
    return rows


def summary(rows: list[dict]) -> str:
    """Per protocol and concurrency: batching on / off throughput of each round (cells of one round ran
    minutes apart at most, so a host's drift affects both sides alike) and their median; at concurrency 1
    also the median 'p50 - engine'."""
    lines = ["", "| protocol    | conc | on/off req/s by round | median ratio | median p50 - engine (on, off) "
                 "| median p50 - engine after idle (on, off) |",
             "|-------------|-----:|-----------------------|-------------:|-------------------------------"
             "|------------------------------------------|"]
    keys = sorted({(r["protocol"], r["concurrency"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for protocol, conc in keys:
        ratios, extra, extra_idle = [], {"on": [], "off": []}, {"on": [], "off": []}
        for round_ in sorted({r["round"] for r in rows}):
            cell = {r["batching"]: r for r in rows
                    if (r["protocol"], r["concurrency"], r["round"]) == (protocol, conc, round_)}
            if "on" in cell and "off" in cell and cell["off"]["throughput_rps"]:
                ratios.append(cell["on"]["throughput_rps"] / cell["off"]["throughput_rps"])
            for side, r in cell.items():
                if r.get("engine_ms") is not None and r["p50_ms"] is not None:
                    extra[side].append(r["p50_ms"] - r["engine_ms"])
                if r.get("engine_paced_ms") is not None and r["p50_ms"] is not None:
                    extra_idle[side].append(r["p50_ms"] - r["engine_paced_ms"])
        shown = " ".join(f"{x:.1f}x" for x in ratios) or "-"
        med = f"{statistics.median(ratios):.1f}x" if ratios else "-"
        ext, ext_idle = (", ".join(f"{statistics.median(v):.2f}" if v else "-" for v in (e["on"], e["off"]))
                         if conc == 1 else "-" for e in (extra, extra_idle))
        lines.append(f"| {protocol:<11} | {conc:>4} | {shown:<21} | {med:>12} | {ext:<29} | {ext_idle:<40} |")
    return "\n".join(lines)


# ---- streams ------------------------------------------------------------------------------------------------


def standard_chunk_sender(grpc_url: str, model: str, n: int):
    """tritonclient.grpc.aio, as a user writes it: ``send(k, x, seq, h, c)`` -> (h_n, c_n) or None."""
    import tritonclient.grpc.aio as tga

    clients = [tga.InferenceServerClient(grpc_url, channel_args=OWN_CONNECTION) for _ in range(grpc_connections(n))]

    def make_input(name, arr):
        t = tga.InferInput(name, list(arr.shape), "FP32")
        t.set_data_from_numpy(arr)
        return t

    async def send(k: int, x: np.ndarray, seq: dict | None, h: np.ndarray, c: np.ndarray):
        inputs = [make_input("input", x)]
        if seq is None:
            inputs += [make_input("h_0", h), make_input("c_0", c)]
        wanted = ["output"] if seq is not None else ["output", "h_n", "c_n"]
        result = await clients[k % len(clients)].infer(model, inputs, outputs=[tga.InferRequestedOutput(o) for o in wanted],
                                                       **(seq or {}))
        return None if seq is not None else (result.as_numpy("h_n"), result.as_numpy("c_n"))

    async def warm() -> None:
        await asyncio.gather(*(client.is_server_live() for client in clients))

    async def close() -> None:
        for client in clients:
            await client.close()

    return send, warm, close


def _chunk_request(pb, model: str, x: np.ndarray, seq: dict | None, h: np.ndarray, c: np.ndarray):
    """A chunk's ModelInferRequest: raw_input_contents, Triton's sequence parameters or h_0/c_0."""
    req = pb.ModelInferRequest(model_name=model)
    arrays = [("input", x)] if seq is not None else [("input", x), ("h_0", h), ("c_0", c)]
    for name, arr in arrays:
        req.inputs.add(name=name, datatype="FP32", shape=list(arr.shape))
        req.raw_input_contents.append(arr.tobytes())
    for name in (("output",) if seq is not None else ("output", "h_n", "c_n")):
        req.outputs.add(name=name)
    if seq is not None:
        req.parameters["sequence_id"].int64_param = seq["sequence_id"]
        req.parameters["sequence_start"].bool_param = seq["sequence_start"]
        req.parameters["sequence_end"].bool_param = seq["sequence_end"]
    return req


def _chunk_states(resp, seq: dict | None, h: np.ndarray, c: np.ndarray):
    """(h_n, c_n) of a stateless chunk's ModelInferResponse; None for a stateful one."""
    if seq is not None:
        return None
    raw = [np.frombuffer(r, np.float32) for r in resp.raw_output_contents]
    return raw[1].reshape(h.shape), raw[2].reshape(c.shape)


def lean_chunk_sender(grpc_url: str, model: str, n: int):
    """Raw ModelInfer calls (raw_input_contents, Triton's sequence parameters): the client's own cost is small."""
    import grpc
    from service.transports.grpc.generated import inference_pb2 as pb

    channels = [grpc.aio.insecure_channel(grpc_url, options=OWN_CONNECTION) for _ in range(grpc_connections(n))]
    calls = [ch.unary_unary("/inference.GRPCInferenceService/ModelInfer") for ch in channels]

    async def send(k: int, x: np.ndarray, seq: dict | None, h: np.ndarray, c: np.ndarray):
        req = _chunk_request(pb, model, x, seq, h, c)
        resp = pb.ModelInferResponse.FromString(await calls[k % len(calls)](req.SerializeToString()))
        return _chunk_states(resp, seq, h, c)

    async def warm() -> None:
        live = [ch.unary_unary("/inference.GRPCInferenceService/ServerLive") for ch in channels]
        await asyncio.gather(*(call(pb.ServerLiveRequest().SerializeToString()) for call in live))

    async def close() -> None:
        for ch in channels:
            await ch.close()

    return send, warm, close


def lean_bidi_chunk_sender(grpc_url: str, model: str, n: int):
    """One ModelStreamInfer call per stream (as ``tritonclient.grpc``'s ``start_stream`` keeps one open),
    each chunk a raw request on it and its answer read back before the next: ``--stream-rpc bidi``."""
    import grpc
    from service.transports.grpc.generated import inference_pb2 as pb

    channels = [grpc.aio.insecure_channel(grpc_url, options=OWN_CONNECTION) for _ in range(grpc_connections(n))]
    open_stream = [ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer") for ch in channels]
    streams: dict[int, object] = {}

    async def send(k: int, x: np.ndarray, seq: dict | None, h: np.ndarray, c: np.ndarray):
        call = streams.get(k)
        if call is None:
            call = streams[k] = open_stream[k % len(open_stream)]()
        await call.write(_chunk_request(pb, model, x, seq, h, c).SerializeToString())
        answer = pb.ModelStreamInferResponse.FromString(await call.read())
        if answer.error_message:
            raise RuntimeError(answer.error_message)
        return _chunk_states(answer.infer_response, seq, h, c)

    async def warm() -> None:
        live = [ch.unary_unary("/inference.GRPCInferenceService/ServerLive") for ch in channels]
        await asyncio.gather(*(call(pb.ServerLiveRequest().SerializeToString()) for call in live))

    async def close() -> None:
        for call in streams.values():
            await call.done_writing()
        for ch in channels:
            await ch.close()

    return send, warm, close


async def stream_cell(grpc_url: str, model: str, first: int, n: int, chunks: int, steps: int, features: int,
                      stateful: bool, state_shape: tuple[int, int], interval: float = 0.0,
                      base: int = 0, total: int = 0, client: str = "lean", rpc: str = "unary",
                      phases: str = "even", start_at: Callable[[], float] | None = None
                      ) -> tuple[list[float], int, float, list[float]]:
    """Streams ``first..first+n-1``, concurrently, each sending ``chunks`` chunks of ``steps`` steps in order.

    The client's gRPC connections are opened first (a ServerLive call on each), outside the measurement.
    ``interval`` 0: each stream sends its next chunk as soon as the previous answer arrives
    (closed loop: the server's saturation). ``interval`` > 0: stream k sends chunk j at
    ``start + offset_k + j * interval`` (or at once when the answer to j-1 came later), like a
    live source producing ``steps`` frames every ``interval`` seconds; offsets spread the streams
    over one interval (``total``: the streams of all processes; ``phases`` "even": stream k at k/total of it,
    "random": at a uniform random point, as independent sources would be), counted from ``start_at()``,
    which the load-generating processes agree on (else from when this one is ready: processes that started
    apart would then crowd some parts of the interval and leave others empty). ``client``: "lean" (raw gRPC
    calls) or "standard" (tritonclient.grpc.aio). ``rpc``: "unary" (a ModelInfer call per chunk) or
    "bidi" (lean only: one ModelStreamInfer call per stream). Returns (latencies in s, errors, elapsed s,
    send times).
    """
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1, steps, features)).astype(np.float32) for _ in range(8)]
    latencies: list[float] = []
    sends: list[float] = []  # perf_counter (CLOCK_MONOTONIC: one clock for every process) of each send
    errors = 0
    senders = {("lean", "unary"): lean_chunk_sender, ("lean", "bidi"): lean_bidi_chunk_sender,
               ("standard", "unary"): standard_chunk_sender}
    send, warm, close = senders[(client, rpc)](grpc_url, model, n)
    # Connections are opened (and the front-ends' gRPC paths used once) before the clock starts, as a live
    # source's client keeps its connection; every chunk of every stream is measured, its first included.
    await warm()

    async def one(k: int, start: float) -> None:
        nonlocal errors
        h = np.zeros((1, *state_shape), np.float32)
        c = np.zeros((1, *state_shape), np.float32)
        for j in range(chunks):
            if interval:
                delay = start + j * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            seq = (dict(sequence_id=base + k + 1, sequence_start=j == 0, sequence_end=j == chunks - 1)
                   if stateful else None)
            t0 = time.perf_counter()
            try:
                states = await send(k, xs[(k + j) % len(xs)], seq, h, c)
            except Exception:  # noqa: BLE001 - counted; a broken stream stops
                errors += 1
                return
            latencies.append(time.perf_counter() - t0)
            sends.append(t0)
            if states is not None:
                h, c = states

    # the wait for the other processes runs off this loop, whose lateness is measured (see _watching_lag)
    t_start = (await asyncio.get_running_loop().run_in_executor(None, start_at) if start_at is not None
               else time.perf_counter())
    spread = max(total, first + n)
    offsets = ((first + np.arange(n)) / spread if phases == "even"
               else np.random.default_rng(7).random(spread)[first:first + n])
    try:
        await asyncio.gather(*(one(first + k, t_start + interval * float(offsets[k])) for k in range(n)))
    finally:
        await close()
    return latencies, errors, time.perf_counter() - t_start, sends


class GcPauses:
    """This process's garbage-collection pauses (a ``gc.callbacks`` hook): a pause of the load generator
    delays every answer it is waiting for at the time, which the latencies then include."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)


class CommonStart:
    """One start time for every load-generating process of a streams cell: each, once its connections are
    warm, raises a shared value to its own clock (CLOCK_MONOTONIC: one clock for every process on the host)
    and waits for the others; all then start a few ms after the last was ready."""

    def __init__(self, ctx: Any, parties: int) -> None:
        self._barrier = ctx.Barrier(parties)
        self._latest = ctx.Value("d", 0.0)

    def __call__(self) -> float:
        with self._latest.get_lock():
            self._latest.value = max(self._latest.value, time.perf_counter())
        self._barrier.wait(timeout=120)
        return self._latest.value + 0.005


def _stream_worker(job: dict, start: CommonStart, results: Any, index: int) -> None:
    """A load-generating process of :func:`run_streams`: puts (index, what :func:`_stream_process` returns)."""
    results.put((index, _stream_process({**job, "start_at": start})))


def _stream_process(job: dict) -> tuple[list[float], int, float, list[float], float]:
    import gc

    sys.setswitchinterval(CLIENT_SWITCH_INTERVAL_S)
    job = dict(job)
    pin(job.pop("cpus", None))
    if job.pop("gc_off", False):
        gc.collect()
        gc.disable()
    watch = GcPauses()
    gc.callbacks.append(watch)
    try:
        (lats, errors, elapsed, sends), late = run_loop(_watching_lag(stream_cell(**job)))
        return lats, errors, elapsed, sends, max(watch.pauses, default=0.0), late
    finally:
        gc.callbacks.remove(watch)
        gc.enable()


async def _watching_lag(main, tick_s: float = 0.005):
    """(``main``'s result, the lateness in s of each of this loop's ``tick_s`` timers that came 2 ms or
    more late while it ran): a load generator whose loop is late delays every answer it is waiting for."""
    loop = asyncio.get_running_loop()
    late: list[float] = []

    async def watch() -> None:
        while True:
            due = loop.time() + tick_s
            await asyncio.sleep(tick_s)
            if loop.time() - due >= 0.002:
                late.append(loop.time() - due)

    watcher = asyncio.create_task(watch())
    try:
        return await main, late
    finally:
        watcher.cancel()


def run_streams(job: dict, n: int, clients: int) -> dict:
    """``n`` streams from ``clients`` load-generating processes (streams split between them)."""
    import multiprocessing as mp
    from queue import Empty

    clients = max(1, min(clients, n))
    shares = [n // clients + (1 if k < n % clients else 0) for k in range(clients)]
    firsts = [sum(shares[:k]) for k in range(clients)]
    jobs = [{**job, "first": f, "n": m, "total": n} for f, m in zip(firsts, shares)]
    if clients == 1:
        results = [_stream_process(jobs[0])]
    else:
        ctx = mp.get_context("spawn")
        start, queue = CommonStart(ctx, clients), ctx.Queue()
        procs = [ctx.Process(target=_stream_worker, args=(j, start, queue, i)) for i, j in enumerate(jobs)]
        for proc in procs:
            proc.start()
        got: dict[int, Any] = {}
        try:
            while len(got) < len(procs):
                try:
                    index, result = queue.get(timeout=1.0)
                    got[index] = result
                except Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError("a load-generating process of the streams cell failed (its error is "
                                           "above)") from None
        finally:
            for proc in procs:
                if len(got) < len(procs):
                    proc.terminate()  # the others would wait for it at the start barrier
                proc.join()
        results = [got[i] for i in range(clients)]
    latencies = [lat for lats, *_ in results for lat in lats]
    sends = np.asarray([t for _, _, _, ts, _, _ in results for t in ts])
    elapsed = max(e for _, _, e, _, _, _ in results)
    late = [x for *_, lags in results for x in lags]
    lat = np.asarray(latencies) * 1000
    return {"mode": "stateful" if job["stateful"] else "stateless", "streams": n, "chunks": len(latencies),
            "chunk_steps": job["steps"], "interval_ms": job["interval"] * 1000, "clients": clients,
            "errors": sum(e for _, e, _, _, _, _ in results), "chunks_per_s": len(latencies) / elapsed,
            "client_gc_max_ms": 1000 * max(g for *_, g, _ in results),
            "client_late_max_ms": 1000 * max(late, default=0.0),
            "client_late_10ms": sum(x >= 0.010 for x in late),
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None, **_tail(sends, lat),
            "send_window": (float(sends.min()), float(sends.max())) if sends.size else None}


def _stalls(lines: list[str]) -> str:
    """The started server's logs among ``lines`` about event-loop stalls and garbage-collection pauses
    (each delays every request of that process) and CUDA graph captures, summed up by kind and by the
    kind of process that logged them ("" when none). Stalls from 20 ms and pauses from 10 ms are
    warnings; ``--server-log-level debug`` adds stalls from 5 ms, pauses from 2 ms, front-ends' messages of
    10 ms or more split into their wait in the lane and their round trip to the engine process, and the
    engine process's messages of 10 ms or more from its read to its answer."""
    found = []
    for what, pattern in (("event-loop stalls", r"blocked for about (\d+) ms"),
                          ("GC pauses", r"paused this process for ([\d.]+) ms"),
                          ("CUDA graph captures", r"captured a CUDA graph for .* in ([\d.]+) ms"),
                          ("engine-process messages of >= 10 ms from read to answer",
                           r"took ([\d.]+) ms in the engine process from its read")):
        hits = [(line, m) for line in lines if (m := re.search(pattern, line))]
        if not hits:
            continue
        roles = Counter(r.group(1) if (r := re.search(r"\[(\w+) \d+\]:", line)) else "server" for line, _ in hits)
        by_role = ", ".join(f"{role} {n}" for role, n in sorted(roles.items()))
        found.append(f"{len(hits)} {what} logged ({by_role}), max {max(float(m.group(1)) for _, m in hits):.0f} ms")
    slow = [m for line in lines if (m := re.search(
        r"of (\d+) requests took ([\d.]+) ms in this front-end: ([\d.]+) ms waiting in its lane .* ([\d.]+) ms "
        r"to the engine", line))]
    if slow:  # front-ends' messages of 10 ms or more (debug): lane wait vs the engine process's round trip
        top = max(slow, key=lambda m: float(m.group(2)))
        lane_s = sum(float(m.group(3)) for m in slow)
        trip_s = sum(float(m.group(4)) for m in slow)
        requests = sum(int(m.group(1)) for m in slow)
        found.append(f"{len(slow)} front-end messages of >= 10 ms logged ({requests} requests), in lanes "
                     f"{lane_s:.0f} ms and to the engine "
                     f"and back {trip_s:.0f} ms in all; slowest {float(top.group(2)):.0f} ms "
                     f"(lane {float(top.group(3)):.0f}, engine and back {float(top.group(4)):.0f})")
    return "; ".join(found)


def _tail(sends: np.ndarray, lat_ms: np.ndarray, slow_ms: float = 10.0, window_s: float = 0.1) -> dict:
    """Where the slow chunks were: stalls (a few windows hold most) or spread over the run.

    ``slow_in_worst_5``: the share of chunks slower than ``slow_ms`` that were sent in the five
    ``window_s`` windows holding the most of them.
    """
    slow = lat_ms > slow_ms
    if not slow.any():
        return {"slow_chunks": 0, "slow_in_worst_5": None, "worst_windows_s": []}
    windows = np.floor((sends[slow] - sends.min()) / window_s).astype(np.int64)
    per_window = np.bincount(windows)
    worst = np.argsort(per_window)[::-1][:5]
    return {"slow_chunks": int(slow.sum()), "slow_in_worst_5": float(per_window[worst].sum() / slow.sum()),
            "worst_windows_s": [round(float(w * window_s), 2) for w in worst if per_window[w]]}


async def bench_streams(args: argparse.Namespace, http_url: str, grpc_url: str | None) -> list[dict]:
    import tritonclient.grpc.aio as tga

    if not grpc_url:
        print("skipping streams: the server has no gRPC port", file=sys.stderr)
        return []
    total = args.stream_chunks or (2000 if args.device == "cuda" else 600)
    client = tga.InferenceServerClient(grpc_url)
    try:
        meta = await client.get_model_metadata(args.stream_model, as_json=True)
    finally:
        await client.close()
    h_shape = next(i["shape"] for i in meta["inputs"] if i["name"] == "h_0")
    state_shape = (int(h_shape[1]), int(h_shape[2]))
    job = {"grpc_url": grpc_url, "model": args.stream_model, "steps": args.chunk_steps, "features": args.features,
           "state_shape": state_shape, "base": int(time.time() * 1000) % 1_000_000 * 10_000, "client": args.client,
           "rpc": args.stream_rpc, "phases": args.stream_phases, "gc_off": args.client_gc == "off", "cpus": args.client_cpus}
    # warm the model (first batches of each size) before measuring
    await stream_cell(first=0, n=16, chunks=3, stateful=True, interval=0.0,
                      **{k: v for k, v in job.items() if k not in ("gc_off", "cpus")})
    rows = []
    for interval_ms in args.chunk_interval_ms:
        for n in args.streams:
            chunks = max(4, total // n) if not interval_ms else max(4, int(args.paced_seconds * 1000 / interval_ms))
            for stateful in (mode == "stateful" for mode in args.stream_modes):
                job["base"] += 100_000
                cell = {**job, "chunks": chunks, "stateful": stateful, "interval": interval_ms / 1000}
                before = server_counters(http_url, args.stream_model)
                logged = len(SERVER_LOG)
                with HostSampler() as host:
                    row = await asyncio.to_thread(run_streams, cell, n, args.clients)
                row.update((row["send_window"] and host.window(*row["send_window"])) or {})
                row.update(server_side(before, server_counters(http_url, args.stream_model)))
                row["server_stalls"] = _stalls(SERVER_LOG[logged:])
                rows.append(row)
                print(_format_stream_row(row), flush=True)
    return rows


def _format_stream_row(r: dict) -> str:
    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    pace = f"{r['interval_ms']:.0f} ms" if r["interval_ms"] else "closed"
    return (f"| {r['mode']:<9} | {pace:>8} | {r['streams']:>7} | {r['chunks']:>6} | {r['chunks_per_s']:>9.1f} | "
            f"{num(r['p50_ms'], '.2f'):>8} | {num(r['p99_ms'], '.2f'):>8} | {num(r.get('server_ms'), '.2f'):>9} | "
            f"{num(r.get('queue_ms'), '.2f'):>8} | "
            f"{num(r.get('avg_batch'), '.1f'):>9} | {num(r.get('batch_ms'), '.2f'):>8} | {r['slow_chunks']:>6} | "
            f"{num(r.get('server_slow'), 'd'):>10} | "
            f"{num(None if r['slow_in_worst_5'] is None else 100 * r['slow_in_worst_5'], '.0f'):>7} | {r['errors']:>6} |"
            + f" client GC pause max {r['client_gc_max_ms']:.1f} ms"
            + (f"; client loops late max {r['client_late_max_ms']:.1f} ms ({r['client_late_10ms']} times >= 10 ms)"
               if "client_late_max_ms" in r else "")
            + (f"; server: {r['server_stalls']}" if r.get("server_stalls") else "")
            + (f"; worst windows at {r['worst_windows_s']} s" if r.get("worst_windows_s") else "")
            + _host_text(r))


def _host_text(r: dict) -> str:
    """The host's CPU over a streams cell's sends (see :class:`procstat.HostSampler`), or ""."""
    if r.get("host_busy_cores") is None:
        return ""
    text = (f"; host: {r['host_busy_cores']:.1f} of {os.cpu_count()} CPUs busy, steal {r['host_steal_cores']:.2f} "
            f"(max {r['host_steal_max_cores']:.1f} in 100 ms)")
    if r.get("host_pressure") is not None:
        text += (f", CPU pressure {100 * r['host_pressure']:.0f}% "
                 f"(max {100 * r['host_pressure_max']:.0f}% in 100 ms)")
    return text


STREAM_HEAD = ("| mode      |   sends  | streams | chunks |  chunks/s |  p50 ms  |  p99 ms  | server ms | queue ms | avg batch "
               "| batch ms "
               "| >10 ms | srv >10 ms | worst5% | errors |\n"
               "|-----------|---------:|--------:|-------:|----------:|---------:|---------:|----------:|---------:|----------:"
               "|---------:"
               "|-------:|-----------:|--------:|-------:|")


async def _ready(http_url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await wait_ready(session, http_url)


def _cores(r: dict) -> str:
    parts = [r.get("engine_main_cores"), r.get("engine_cores"), r.get("frontend_cores"), r.get("client_cores")]
    return "/".join("-" if v is None else f"{v:.1f}" for v in parts)


def _format_row(r: dict) -> str:
    p50 = f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "-"
    p99 = f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "-"
    extra = f"{r['p50_ms'] - r['engine_ms']:.2f}" if r.get("engine_ms") is not None and r["p50_ms"] is not None else "-"
    batch = f"{r['avg_batch']:.1f}" if r.get("avg_batch") else "-"
    busy = f"{100 * r['engine_busy']:.0f}%" if r.get("engine_busy") is not None else "-"
    return (f"| {r['protocol']:<11} | {r['batching']:<8} | {r['concurrency']:>4} | {r['throughput_rps']:>9.1f} | "
            f"{p50:>8} | {p99:>8} | {extra:>13} | {batch:>9} | {busy:>11} | {_ms(r.get('server_ms')):>7} | "
            f"{_ms(r.get('queue_ms')):>8} | {_ms(r.get('batch_ms')):>8} | {_cores(r):>19} | {r['errors']:>6} |")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# avg batch: sequences per engine call; engine busy: share of the cell's time the engine computed; srv ms: mean
# time of a request in the engine process (arrival to answer); queue ms: its wait for a batch; batch ms: mean time
# of a batch from launch to results (the server's metrics); cores main/eng/fe/cli: CPU cores used by the engine
# process's main thread (its event loop, batching and launches), the whole engine process, all front-end processes
# and all load-generating processes over the measured window (Linux /proc)
TABLE_HEAD = ("| protocol    | batching | conc |     req/s |  p50 ms  |  p99 ms  | p50 - engine | avg batch | engine busy "
              "| srv ms  | queue ms | batch ms | cores main/eng/fe/cli | errors |\n"
              "|-------------|----------|-----:|----------:|---------:|---------:|-------------:|----------:|------------:"
              "|--------:|---------:|---------:|----------------------:|-------:|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="HTTP host:port of a running server (default: start one)")
    p.add_argument("--grpc-url", help="gRPC host:port of that server")
    p.add_argument("--model", default="bench", help="model to drive with --url (default bench)")
    p.add_argument("--server-pid", type=int, default=0,
                   help="with --url: the server's (engine) process id, for the table's CPU columns")
    p.add_argument("--no-compare", action="store_true", help="with --url: skip the <model>_nobatch comparison")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="device of the started server")
    p.add_argument("--features", type=int, default=40, help="input features I (default 40)")
    p.add_argument("--hidden", type=int, default=128, help="LSTM hidden size H (default 128)")
    p.add_argument("--layers", type=int, default=1, help="LSTM layers (default 1)")
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 64])
    p.add_argument("--protocols", type=lambda s: s.split(","), default=["http-json", "http-binary", "grpc"],
                   help="of http-json, http-binary, grpc (grpc.aio client), grpc-sync (a blocking gRPC client on "
                        "threads, as tritonclient.grpc: one thread hand-off less per call on the client's side)")
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per cell (default 3)")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds per cell (default 0.5)")
    p.add_argument("--pool", type=int, default=64, help="distinct pre-built requests (default 64)")
    p.add_argument("--clients", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="load-generating processes per cell, concurrency split between them (default: half the "
                        "CPUs, at most 8), so that the Python client is not the bottleneck")
    p.add_argument("--client-gc", choices=["on", "off"], default="off",
                   help="off (default): the load generator's processes run with Python's garbage collector "
                        "disabled. Each process stands for many independent clients, and one collection pause "
                        "(up to 26 ms seen on an H100 host) delayed every answer it was waiting for at once, "
                        "which no real client population does; the streams table reports the longest pause "
                        "either way. on: Python's default")
    p.add_argument("--client", choices=["lean", "standard"], default="lean",
                   help="lean (default): pre-encoded requests on raw keep-alive HTTP connections and a raw gRPC "
                        "channel, answers parsed, a few µs a request, so the numbers are the server's; standard: "
                        "aiohttp and tritonclient.grpc.aio, what many users run (~150-500 µs a request of client CPU)")
    p.add_argument("--grpc-calls-per-connection", type=int, default=CALLS_PER_CONNECTION,
                   help=f"requests scenario: concurrent gRPC calls a client process puts on one connection "
                        f"(default {CALLS_PER_CONNECTION}); each connection lands on one front-end process")
    p.add_argument("--scenario", choices=["all", "requests", "streams"], default="all",
                   help="requests (one-shot sequences), streams (stateful vs stateless chunks), or all (default)")
    p.add_argument("--streams", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16, 256],
                   help="concurrent streams per cell (default 1,16,256)")
    p.add_argument("--chunk-steps", type=int, default=10, help="time steps per stream chunk (default 10)")
    p.add_argument("--stream-chunks", type=int, default=0,
                   help="chunks per cell, shared over its streams (at least 4 per stream; default 2000 on cuda, "
                        "600 otherwise)")
    p.add_argument("--stream-modes", type=lambda s: s.split(","), default=["stateful", "stateless"],
                   help="which of stateful,stateless the streams scenario runs (default both)")
    p.add_argument("--chunk-interval-ms", type=lambda s: [float(c) for c in s.split(",")], default=[0.0, 100.0],
                   help="how each stream sends its chunks: 0 = the next as soon as the answer arrives (closed loop, "
                        "the server's saturation), T > 0 = one every T ms like a live source (default 0,100: a "
                        "10-step chunk every 100 ms is real time for 10 ms audio frames)")
    p.add_argument("--paced-seconds", type=float, default=5.0,
                   help="how long each paced (T > 0) streams cell runs (default 5 s)")
    p.add_argument("--stream-phases", choices=["even", "random"], default="even",
                   help="paced streams' send times within the interval: evenly spread over it (default) or at "
                        "uniform random points, as independent sources would be (bursts of arrivals)")
    p.add_argument("--stream-rpc", choices=["unary", "bidi"], default="unary",
                   help="how stream chunks travel: a ModelInfer call each (default) or, with --client lean, one "
                        "ModelStreamInfer call per stream kept open for all its chunks")
    p.add_argument("--stream-queue-delay-us", type=int, default=None,
                   help="max_queue_delay_us of the started server's stream model (default: the server's, 0)")
    p.add_argument("--stream-hidden", type=int, default=256, help="H of the streaming LSTM (default 256)")
    p.add_argument("--stream-layers", type=int, default=2, help="layers of the streaming LSTM (default 2)")
    p.add_argument("--stream-model", default="bench_stream", help="model the streams drive (default bench_stream)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every requests cell (default 1); the summary gives each round's batching on/off "
                        "ratio and their median")
    p.add_argument("--engines", type=int, default=1,
                   help="engine processes of the started server (rnnserve serve --engines; default 1); with more "
                        "than one, the 'main' and 'eng' CPU columns are engine process 0's, 'fe' counts the others")
    p.add_argument("--frontends", type=int, default=1,
                   help="front-end processes of the started server (rnnserve serve --frontends; default 1)")
    p.add_argument("--graph-memory-mb", type=int, default=None,
                   help="cuda_graph_memory_mb of the started server's models (default: the config's; 0: no CUDA graphs)")
    p.add_argument("--queue-delay-us", type=int, default=None,
                   help="max_queue_delay_us of the started server's request models (default: the config's, 0)")
    p.add_argument("--client-cpus", type=cpu_list, default=None,
                   help="CPUs the load-generating processes run on, e.g. 10-15 (default: any): with --server-cpus, "
                        "clients do not take CPU time from the server, as when they run on other machines")
    p.add_argument("--server-cpus", type=cpu_list, default=None,
                   help="CPUs the started server (all its processes) runs on, e.g. 0-9 (default: any)")
    p.add_argument("--server-grpc-experiments", default=None,
                   help="GRPC_EXPERIMENTS of the started server only, e.g. '' for grpc's defaults (default: the "
                        "load generator's, which is rnnserve's setting unless GRPC_EXPERIMENTS is set)")
    p.add_argument("--server-log-level", default="warning", choices=["warning", "info", "debug"],
                   help="--log-level of the started server (info: streams rows also count its CUDA graph captures; "
                        "debug: and its event-loop stalls from 5 ms and GC pauses from 2 ms, not only from 20 / 10)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.stream_rpc == "bidi" and args.client != "lean":
        p.error("--stream-rpc bidi needs --client lean")

    proc = None
    tmp = None
    if args.url:
        http_url, grpc_url = args.url, args.grpc_url
        models = [args.model] if args.no_compare else [args.model, f"{args.model}_nobatch"]
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rnnserve-bench-")
        repo = Path(tmp.name) / "models"
        extra = {} if args.graph_memory_mb is None else {"cuda_graph_memory_mb": args.graph_memory_mb}
        if args.queue_delay_us is not None:
            extra["max_queue_delay_us"] = args.queue_delay_us
        write_repository(repo, args.features, args.hidden, args.layers, extra)
        stream_extra = {k: v for k, v in extra.items() if k != "max_queue_delay_us"}
        stream_extra = stream_extra if args.stream_queue_delay_us is None else {
            **stream_extra, "max_queue_delay_us": args.stream_queue_delay_us}
        write_stream_model(repo, args.features, args.stream_hidden, args.stream_layers, stream_extra)
        proc, http_url, grpc_url = start_server(repo, args.device, ["--frontends", str(args.frontends),
                                                                    "--engines", str(args.engines)],
                                                args.server_cpus, args.server_grpc_experiments, args.server_log_level)
        args.server_pid = proc.pid
        models = ["bench", "bench_nobatch"]
    rows: list[dict] = []
    stream_rows: list[dict] = []
    try:
        if args.scenario in ("all", "requests"):
            print(f"rnnserve bench: LSTM I={args.features} H={args.hidden} L={args.layers}, lengths "
                  f"{args.min_len}..{args.max_len}, output_last, {args.duration:.0f}s per cell, "
                  f"{os.cpu_count()} CPUs, device {args.device}, server {http_url} (gRPC {grpc_url or 'off'}), "
                  f"{args.frontends} front-end process(es), {args.engines} engine process(es)")
            args.engine_ms = args.engine_paced_ms = None
            if tmp is not None:
                seqs = make_sequences(args.pool, args.features, args.min_len, args.max_len)
                args.engine_ms, args.engine_paced_ms = engine_alone_ms(repo, args.device, seqs)
                print(f"engine alone ({args.device}), one sequence per call: p50 {args.engine_ms:.3f} ms back to "
                      f"back, {args.engine_paced_ms:.3f} ms after 1 ms idle (as requests at concurrency 1 arrive); "
                      f"'p50 - engine' is what the service adds at concurrency 1 over the back-to-back time")
            print(TABLE_HEAD, flush=True)
            rows = asyncio.run(bench(args, http_url, grpc_url, models))
        if args.scenario in ("all", "streams"):
            if args.scenario == "streams":
                asyncio.run(_ready(http_url))
            print(f"\nrnnserve streams: LSTM I={args.features} H={args.stream_hidden} L={args.stream_layers}, "
                  f"{args.chunk_steps}-step chunks over gRPC "
                  f"({'a ModelStreamInfer call per stream' if args.stream_rpc == 'bidi' else 'a ModelInfer call each'}), stateful (sequence_id) vs stateless (client sends "
                  f"h_0/c_0), paced streams' phases {args.stream_phases} over {args.clients} load-generating "
                  f"processes, {os.cpu_count()} CPUs, device {args.device}")
            print(STREAM_HEAD, flush=True)
            stream_rows = asyncio.run(bench_streams(args, http_url, grpc_url))
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
            "streams": {"model": {"cell": "lstm", "features": args.features, "hidden": args.stream_hidden,
                                  "layers": args.stream_layers}, "chunk_steps": args.chunk_steps,
                        "results": stream_rows},
        }, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
