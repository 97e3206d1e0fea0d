"""Support for serving tests: tiny random models, an in-process REST client, a real server process.

Models are built with service.spec/packing directly, not with the loaders.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.app import build_dataplane
from service.packing import LayerWeights, pack_block
from service.repository import PackedModel
from service.settings import ServeSettings
from service.spec import BlockSpec, RNNSpec
from service.transports.rest import create_rest_app

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"rnnserve: HTTP on ([^:\s]+):(\d+), (?:gRPC on ([^:\s]+):(\d{1,5})(?!\d)|gRPC off)")


def make_model(*blocks: BlockSpec, seed: int = 0) -> PackedModel:
    """A PackedModel with random weights for ``blocks``."""
    rng = np.random.default_rng(seed)
    weights = []
    for blk in blocks:
        g, h, ho = blk.gates, blk.hidden_size, blk.output_size
        layers = []
        for p in range(blk.pseudo_layers):
            in_p = blk.layer_input_size(p // blk.directions)
            layers.append(LayerWeights(
                rng.normal(0, 0.4, (g * h, in_p)), rng.normal(0, 0.4, (g * h, ho)),
                rng.normal(0, 0.1, g * h), rng.normal(0, 0.1, g * h),
                rng.normal(0, 0.4, (ho, h)) if blk.proj_size else None))
        weights.append(pack_block(blk, layers))
    return PackedModel(RNNSpec(tuple(blocks)), weights)


LSTM = (BlockSpec("lstm", 4, 8, num_layers=2),)
GRU_BI = (BlockSpec("gru", 4, 6, bidirectional=True),)


def write_config(repo: Path, name: str, **fields: Any) -> None:
    path = repo / name / "config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))


def build_repository(repo: Path) -> Path:
    """lstm (2-layer LSTM, I=4, H=8) and gru_bi (bidirectional GRU, I=4, H=6)."""
    make_model(*LSTM, seed=1).save(repo, "lstm", 1)
    make_model(*GRU_BI, seed=2).save(repo, "gru_bi", 1)
    return repo


STREAM_MODELS = {
    "lstm2": (BlockSpec("lstm", 4, 8, num_layers=2),),
    "gru2": (BlockSpec("gru", 4, 6, num_layers=2),),
    "rnn2": (BlockSpec("rnn_tanh", 4, 5, num_layers=2),),
    # blocks of different state widths (like models/wave_classifier): no single h_0/h_n tensor
    "mixed": (BlockSpec("gru", 4, 12), BlockSpec("gru", 12, 3)),
    "gru_bi": GRU_BI,
}


def build_stream_repository(repo: Path) -> Path:
    """Models for stream tests: multi-layer lstm2/gru2/rnn2, mixed widths, gru_bi, and two copies of lstm2:
    ``lstm_short`` (max_streams 2, stream_idle_timeout_s 0.5) and ``lstm_unload`` (for unloading)."""
    for seed, (name, blocks) in enumerate(STREAM_MODELS.items()):
        make_model(*blocks, seed=seed + 10).save(repo, name, 1)
    lstm = make_model(*STREAM_MODELS["lstm2"], seed=10)
    lstm.save(repo, "lstm_short", 1)
    write_config(repo, "lstm_short", max_streams=2, stream_idle_timeout_s=0.5)
    lstm.save(repo, "lstm_unload", 1)
    # A window that lets chunks of concurrent streams meet in one batch.
    for name in ("lstm2", "gru2", "rnn2", "mixed"):
        write_config(repo, name, max_queue_delay_us=2000)
    return repo


@contextlib.asynccontextmanager
async def rest_client(repository: Path, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """A started dataplane and an httpx client on its REST app (in process)."""
    cfg = ServeSettings(repository=repository, device="cpu", **settings)
    dataplane = build_dataplane(cfg)
    await dataplane.start()
    app = create_rest_app(dataplane, cfg.max_request_bytes, cfg.body_timeout_s)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rnnserve") as client:
            yield client, dataplane
    finally:
        await dataplane.stop(drain=True)


@contextlib.asynccontextmanager
async def lstm_dataplane(repo: Path, seed: int, **config: Any) -> AsyncIterator[Any]:
    """A started DataPlane (reference engine) on a repository of one LSTM model, "lstm", with ``config``."""
    from service.dataplane import DataPlane
    from service.registry import ModelRegistry

    make_model(*LSTM, seed=seed).save(repo, "lstm", 1)
    write_config(repo, "lstm", **config)
    dp = DataPlane(ModelRegistry(repo, device="cpu"))
    await dp.start()
    try:
        yield dp
    finally:
        await dp.stop()


def start_server(repository: Path, *extra: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0, device: str = "cpu",
                 output: list[str] | None = None) -> tuple[subprocess.Popen, str, str | None]:
    """Start `python -m service.cli serve` on free ports; return (process, http_url, grpc_url or None).

    ``output``: the server's output lines are appended to it as they come (else they are read and dropped)."""
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repository), "--host", "127.0.0.1",
           "--http-port", "0", "--grpc-port", "0", "--device", device, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = LINE.search(line)
        if m:
            http_url = f"http://{m.group(1)}:{m.group(2)}"
            grpc_url = f"grpc://{m.group(3)}:{m.group(4)}" if m.group(3) else None
            if output is not None:
                output.extend(seen)
            _drain_output(proc, output)
            _wait_ready(http_url, deadline)
            return proc, http_url, grpc_url
    proc.kill()
    proc.wait()
    proc.stdout.close()
    raise RuntimeError("rnnserve did not start:\n" + "".join(seen))


def _drain_output(proc: subprocess.Popen, output: list[str] | None = None) -> None:
    """Read the server's output until it exits (a full pipe would block it), then close the pipe (left open, it
    was a ResourceWarning in the test that started the server); the lines go to ``output`` when given."""
    import threading

    def drain() -> None:
        with proc.stdout:
            for line in proc.stdout:
                if output is not None:
                    output.append(line)

    threading.Thread(target=drain, daemon=True).start()


def _wait_ready(http_url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{http_url}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"rnnserve at {http_url} did not become ready")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM the server and return its exit code."""
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)




def triton_inputs(module: Any, x: np.ndarray, lengths: np.ndarray) -> list:
    """``input`` (FP32) and ``lengths`` (INT32) as tritonclient InferInputs of ``module`` (.grpc or .http)."""
    a = module.InferInput("input", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = module.InferInput("lengths", list(lengths.shape), "INT32")
    b.set_data_from_numpy(lengths)
    return [a, b]


def metric_value(dataplane: Any, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` (among others) in ``dataplane``'s exposition, 0 when absent."""
    for family in text_string_to_metric_families(dataplane.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
