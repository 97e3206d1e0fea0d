"""End to end: a real `rnnserve serve` process and the real tritonclient.http (binary and JSON)."""
from __future__ import annotations

import time

import gevent
import numpy as np
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from service import create_engine
from service.repository import load_model
from serving_support import start_server, stop_server

pytestmark = pytest.mark.slow


def _host(url: str) -> str:
    return url.split("://", 1)[-1]


def _inputs(x, lengths, binary):
    a = th.InferInput("input", list(x.shape), "FP32")
    a.set_data_from_numpy(x, binary_data=binary)
    b = th.InferInput("lengths", list(lengths.shape), "INT32")
    b.set_data_from_numpy(lengths, binary_data=binary)
    return [a, b]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_end_to_end(server_process, model_repository, binary):
    http_url, _ = server_process
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 9, 4)).astype(np.float32)
    lengths = np.array([9, 4, 1], dtype=np.int32)
    expected = create_engine(load_model(model_repository / "lstm"), "cpu").forward(x, lengths)
    with th.InferenceServerClient(_host(http_url)) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata()["name"] == "rnnserve"
        assert client.is_model_ready("lstm") and client.is_model_ready("gru_bi", "1")
        meta = client.get_model_metadata("lstm")
        assert meta["platform"] == "rnnserve_reference" and meta["inputs"][0]["shape"] == [-1, -1, 4]
        index = client.get_model_repository_index()
        assert {(m["name"], m["state"]) for m in index} == {("lstm", "READY"), ("gru_bi", "READY")}

        outputs = [th.InferRequestedOutput(n, binary_data=binary) for n in ("output", "output_last", "h_n", "c_n")]
        result = client.infer("lstm", _inputs(x, lengths, binary), outputs=outputs, request_id="e2e")
        assert result.get_response()["id"] == "e2e"
        np.testing.assert_allclose(result.as_numpy("output"), expected.output, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("output_last"), expected.output[[0, 1, 2], lengths - 1], atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("h_n"), expected.h_n, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("c_n"), expected.c_n, atol=1e-5)

        default = client.infer("lstm", _inputs(x, lengths, binary))  # no outputs: all, binary
        np.testing.assert_allclose(default.as_numpy("output"), expected.output, atol=1e-5)

        # compressed both ways (tritonclient's request and response compression), as Triton answers them
        for coding in ("gzip", "deflate"):
            packed = client.infer("lstm", _inputs(x, lengths, binary), outputs=outputs,
                                  request_compression_algorithm=coding, response_compression_algorithm=coding)
            for name in ("output", "h_n", "c_n"):
                np.testing.assert_array_equal(packed.as_numpy(name), result.as_numpy(name))

        # a stream in two chunks (sequence_id), equal to the whole first sequence
        one = x[:1]
        client.infer("lstm", _inputs(one[:, :5].copy(), np.array([5], np.int32), binary), sequence_id=11,
                     sequence_start=True)
        tail = client.infer("lstm", _inputs(one[:, 5:].copy(), np.array([4], np.int32), binary), sequence_id=11,
                            sequence_end=True)
        np.testing.assert_allclose(tail.as_numpy("h_n"), expected.h_n[:1], atol=1e-5)

        with pytest.raises(InferenceServerException, match="input 'input' has 3 features, model 'lstm' expects 4"):
            client.infer("lstm", _inputs(x[:, :, :3].copy(), lengths, binary))
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            client.infer("nope", _inputs(x, lengths, binary))
        assert client.is_server_live()


def test_tritonclient_http_repository_control(server_process):
    http_url, _ = server_process
    with th.InferenceServerClient(_host(http_url)) as client:
        client.unload_model("gru_bi")
        assert not client.is_model_ready("gru_bi")
        client.load_model("gru_bi")
        assert client.is_model_ready("gru_bi")
        with pytest.raises(InferenceServerException, match="no model 'ghost'"):
            client.load_model("ghost")
        # tritonclient's config override is refused by name, and the model keeps serving as configured
        with pytest.raises(InferenceServerException, match=r"load parameters are not supported \(got config\)"):
            client.load_model("gru_bi", config='{"max_batch_size": 8}')
        assert client.is_model_ready("gru_bi")


def test_sigterm_drains_in_flight_requests(tmp_path):
    from serving_support import build_repository

    repo = build_repository(tmp_path / "models")
    # NumPy's ~20 us a step keeps these requests in flight at SIGTERM; the compiled LSTM
    # kernel would finish them first.
    proc, http_url, grpc_url = start_server(repo, "--max-batch-size", "1", env={"RNNSERVE_NATIVE_CPU": "0"})
    x = np.random.default_rng(0).standard_normal((1, 20000, 4)).astype(np.float32)
    # One client with 3 connections on this thread: tritonclient's gevent pool must be closed on the thread
    # that made it (clients made on worker threads were collected on others: InvalidThreadUseError warnings).
    with th.InferenceServerClient(_host(http_url), concurrency=3, network_timeout=60) as client:
        pending = [client.async_infer("lstm", _inputs(x, np.array([20000], np.int32), True)) for _ in range(3)]
        gevent.sleep(0.5)  # the client's greenlets send the requests and wait
        in_flight = sum(not p._greenlet.ready() for p in pending)
        start = time.monotonic()
        rc = stop_server(proc, timeout=60)
        results = [p.get_result().as_numpy("output_last") for p in pending]
    assert rc == 0
    assert all(r.shape == (1, 8) for r in results), results
    assert time.monotonic() - start < 30
    assert in_flight, "every request finished before SIGTERM; the test did not exercise the drain"


def test_startup_errors_exit_nonzero_with_a_message(tmp_path):
    import socket
    import subprocess
    import sys

    from serving_support import ROOT

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, code, message in [
            (["--http-port", str(port)], 1, f"cannot listen on 127.0.0.1:{port}"),
            (["--max-batch-size", "0"], 2, "--max-batch-size: Input should be greater than or equal to 1"),
        ]:
            run = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--repository", str(tmp_path),
                                  "--host", "127.0.0.1", "--grpc-port", "-1", *args],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert run.returncode == code and message in run.stderr, run.stderr


def test_device_cuda_without_a_usable_gpu_stops_at_start(tmp_path):
    """Every model used to fail with the same reason while the server reported ready and took traffic."""
    import subprocess
    import sys

    from service.engines.factory import cuda_problem

    if cuda_problem() is None:
        pytest.skip("this machine can serve on cuda")
    res = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--device", "cuda", "--http-port", "0",
                          "--grpc-port", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: --device cuda cannot serve here: the cuDNN engine") and \
        "serve with --device auto" in res.stderr and "Traceback" not in res.stderr
