"""SIGTERM with requests that cannot finish within --drain-timeout-s: they are cut off with an answer a client
can retry on another replica (REST 503 with the service's JSON error, gRPC UNAVAILABLE), not uvicorn's plain-text
500, and the server still exits 0. A real `rnnserve serve` process, in both layouts."""
from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from serving_support import LSTM, build_repository, make_model, start_server, stop_server, write_config

pytestmark = pytest.mark.slow
HELD = ("lstm", "gru_bi", "lstm_predict")  # one held request each: REST infer, gRPC infer, REST predict


def _queued(http_url: str) -> dict[str, float]:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return {s.labels["model"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "rnnserve_queue_depth"}


@pytest.mark.parametrize("layout", [(), ("--frontends", "2")], ids=["one-process", "front-ends"])
def test_requests_cut_off_by_the_drain_timeout_get_503_json_and_unavailable(tmp_path, layout):
    repo = build_repository(tmp_path / "models")
    make_model(*LSTM, seed=3).save(repo, "lstm_predict", 1)
    for name in HELD:
        # a lone request waits the whole 10 s for a fuller batch: still queued when the 0.5 s drain ends
        write_config(repo, name, max_batch_size=8, max_queue_delay_us=10_000_000)
    proc, http_url, grpc_url = start_server(repo, "--drain-timeout-s", "0.5", *layout)
    x = np.zeros((1, 3, 4), np.float32)
    answers: dict[str, Any] = {}

    def rest_infer() -> None:
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 4], "data": x.ravel().tolist()}]}
        answers["infer"] = httpx.post(f"{http_url}/v2/models/lstm/infer", json=body, timeout=30)

    def rest_predict() -> None:
        answers["predict"] = httpx.post(f"{http_url}/v1/models/lstm_predict:predict",
                                        json={"instances": [x[0].tolist()]}, timeout=30)

    def grpc_infer() -> None:
        inp = tg.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        with tg.InferenceServerClient(grpc_url.split("://")[1]) as client:
            try:
                answers["grpc"] = client.infer("gru_bi", [inp], client_timeout=30)
            except InferenceServerException as exc:
                answers["grpc"] = exc

    threads = [threading.Thread(target=f) for f in (rest_infer, grpc_infer, rest_predict)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while not all(_queued(http_url).get(name, 0) >= 1 for name in HELD):
            assert time.monotonic() < deadline, f"the requests did not queue: {_queued(http_url)}"
            time.sleep(0.05)
        start = time.monotonic()
        rc = stop_server(proc, timeout=30)
        stopped = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
        for t in threads:
            t.join(30)
    assert rc == 0
    assert stopped < 8, f"the server took {stopped:.1f}s to stop; the drain timeout is 0.5s"
    for route in ("infer", "predict"):
        r = answers[route]
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", (route, r.text)
        assert "the server is shutting down" in r.json()["error"] and "retry it on another replica" in r.json()["error"]
    assert isinstance(answers["grpc"], InferenceServerException), answers["grpc"]
    # the service's own answer, as on REST (grpc.aio's cancel at its grace period said "Cancelling all calls")
    assert answers["grpc"].status() == "StatusCode.UNAVAILABLE", answers["grpc"]
    assert "the server is shutting down" in answers["grpc"].message(), answers["grpc"]
    assert "retry it on another replica" in answers["grpc"].message(), answers["grpc"]


@pytest.mark.parametrize("layout", [(), ("--frontends", "2")], ids=["one-process", "front-ends"])
def test_open_streams_and_health_watches_do_not_hold_the_drain(tmp_path, layout):
    """An idle ModelStreamInfer call and a grpc.health.v1 Watch held SIGTERM for the whole drain timeout (30 s by
    default: past Docker's 10 s stop, so the container was killed), and were then told their requests had not
    finished in time. Now the stream answers what it was sent and ends with UNAVAILABLE, the watch sends
    NOT_SERVING and ends, and the server exits at once."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from service.transports.grpc.generated import inference_pb2 as pb
    from service.transports.grpc.generated import inference_pb2_grpc as pb_grpc

    repo = build_repository(tmp_path / "models")
    proc, _, grpc_url = start_server(repo, "--drain-timeout-s", "30", *layout)
    target = grpc_url.split("://")[1]
    channels = [grpc.insecure_channel(target) for _ in range(2)]
    try:
        requests: list[Any] = []
        wake = threading.Condition()

        def chunks():  # one request, then nothing until the test ends the iterator
            req = pb.ModelInferRequest(model_name="lstm")
            req.inputs.add(name="input", datatype="FP32", shape=[1, 3, 4])
            req.raw_input_contents.append(np.zeros((1, 3, 4), np.float32).tobytes())
            yield req
            with wake:
                wake.wait_for(lambda: requests, timeout=60)

        stream = pb_grpc.GRPCInferenceServiceStub(channels[0]).ModelStreamInfer(chunks(), timeout=60)
        first = next(stream)
        assert not first.error_message and first.infer_response.model_name == "lstm"
        watch = health_pb2_grpc.HealthStub(channels[1]).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        start = time.monotonic()
        proc.send_signal(__import__("signal").SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the server is stopping: this ModelStreamInfer call ends here, after answering the first 1 " \
               "request(s) it sent, in order; later ones were not run" in ended.value.details()
        assert [r.status for r in watch] == [health_pb2.HealthCheckResponse.NOT_SERVING]  # then the call ends OK
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 10, "the drain waited for idle calls"
    finally:
        with wake:
            requests.append(None)
            wake.notify_all()
        for channel in channels:
            channel.close()
        if proc.poll() is None:
            proc.kill()


_SLOW_BUILD = '''
import time
import service.registry.registry as registry

_build = registry.ModelRegistry._build


def _slow_build(self, *args, **kwargs):
    time.sleep(60)  # a model whose engine takes minutes to build (a large model, cuDNN autotuning)
    return _build(self, *args, **kwargs)


registry.ModelRegistry._build = _slow_build
'''


@pytest.mark.parametrize("layout", [(), ("--frontends", "2")], ids=["one-process", "front-ends"])
def test_sigterm_during_a_model_load_exits_without_waiting_for_it(tmp_path, layout):
    """A load cannot be interrupted (it runs on a thread); the process used to exit only once it had ended."""
    import os
    import signal
    import subprocess
    import sys

    from serving_support import LINE, ROOT

    repo = build_repository(tmp_path / "models")
    hook = tmp_path / "hook"
    hook.mkdir()
    # sitecustomize runs in every process of the server (spawned children inherit PYTHONPATH)
    (hook / "sitecustomize.py").write_text(_SLOW_BUILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(hook), str(ROOT), os.environ.get("PYTHONPATH")]
                                                       if p)}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--repository", str(repo), "--host",
                             "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--device", "cpu", *layout],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if LINE.search(line):
                break
        assert seen and LINE.search(seen[-1]), "the server did not start:\n" + "".join(seen)
        http_url = "http://{}:{}".format(*LINE.search(seen[-1]).groups()[:2])
        deadline = time.monotonic() + 30
        while httpx.get(f"{http_url}/v2/health/live", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)  # the loads have started (and sleep)
        assert httpx.get(f"{http_url}/v2/health/ready", timeout=5).status_code != 200, "the models loaded already"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
        took = time.monotonic() - start
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert rc == 0, "".join(seen) + rest
    assert took < 15, f"exited {took:.0f} s after SIGTERM"
    assert "Traceback" not in rest, rest
