"""Start a real rnnserve process (or Prometheus) for the deploy tests and always stop it.

Everything listens on 127.0.0.1 with ports the OS picks; every wait is bounded.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np

LOG_LINE = re.compile(r"rnnserve: HTTP on (?P<host>\S+):(?P<http>\d+), gRPC on (?P<ghost>\S+):(?P<grpc>\d{1,5})(?!\d)")
TINY_MODEL = "tiny_lstm"


def write_tiny_model(repository: Path) -> Path:
    """A 1-layer LSTM (I=3, H=4) with seeded weights, saved as REPO/tiny_lstm/1/model.safetensors."""
    from service.packing import LayerWeights, pack_block
    from service.repository import PackedModel
    from service.spec import BlockSpec, RNNSpec

    rng = np.random.default_rng(6)
    block = BlockSpec("lstm", input_size=3, hidden_size=4)
    g, h = block.gates, block.hidden_size
    layer = LayerWeights(rng.normal(0, 0.5, (g * h, 3)), rng.normal(0, 0.5, (g * h, h)),
                         rng.normal(0, 0.1, g * h), rng.normal(0, 0.1, g * h))
    model = PackedModel(RNNSpec((block,)), [pack_block(block, [layer])])
    return model.save(repository, TINY_MODEL, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``check()`` until it returns a truthy value; fail with the process log after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{tail(log)}")
        try:
            last = check()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})\n{tail(log)}")


def tail(log: Path | None, chars: int = 4000) -> str:
    if log is None or not log.exists():
        return ""
    return "--- log ---\n" + log.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def running(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` with stdout+stderr in ``log``; on exit SIGTERM it, then SIGKILL after 15 s."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def bound_ports(proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> tuple[int, int]:
    """(http_port, grpc_port) from the server's `rnnserve: HTTP on ..., gRPC on ...` line."""
    match = wait_until(lambda: LOG_LINE.search(log.read_text(errors="replace")), timeout,
                       "the 'rnnserve: HTTP on ...' line", proc, log)
    return int(match["http"]), int(match["grpc"])


def wait_ready(proc: subprocess.Popen, http_port: int, log: Path, timeout: float = 60.0) -> None:
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    wait_until(lambda: http_json(url, timeout=2)[0] == 200, timeout, f"{url} to answer 200", proc, log)


def infer_and_check(http_port: int, repository: Path, batch: int = 2) -> None:
    """One V2 REST inference on the tiny model, compared with the reference engine in this process."""
    from service.engines import create_engine
    from service.repository import load_model

    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 5, 3)).astype(np.float32)
    lengths = np.array([5] + [3] * (batch - 1), dtype=np.int32)
    body = {"inputs": [
        {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()},
        {"name": "lengths", "shape": [batch], "datatype": "INT32", "data": lengths.tolist()},
    ], "outputs": [{"name": "output"}]}
    status, resp = http_json(f"http://127.0.0.1:{http_port}/v2/models/{TINY_MODEL}/infer", body)
    assert status == 200, f"inference failed with {status}: {resp}"
    (out,) = [o for o in resp["outputs"] if o["name"] == "output"]
    got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    expected = create_engine(load_model(repository / TINY_MODEL), "cpu").forward(x, lengths).output
    np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-4, atol=1e-5)


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment minus Python/venv variables that would leak this test run into a child."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTEST_CURRENT_TEST", "PIP_REQUIRE_VIRTUALENV")}
    env.update(extra)
    return env


