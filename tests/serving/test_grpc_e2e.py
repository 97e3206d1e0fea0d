"""End to end: the real ``tritonclient.grpc`` against a real ``rnnserve serve`` process.

Uses the ``server_process`` fixture of tests/serving/conftest.py, which yields
(http_url, grpc_url) of a started server; the test skips while that fixture does not
exist. When conftest also provides ``model_repository`` (the folder the process
serves), gRPC answers are checked against the reference engine on the same weights;
otherwise against the same process's REST answer (tritonclient.http).
"""
from __future__ import annotations

import numpy as np
import pytest

from serving_support import triton_inputs

tg = pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.slow


def _fixture(request, name):
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        return None


def _host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def test_tritonclient_grpc_against_real_server(request):
    urls = _fixture(request, "server_process")
    if urls is None:
        pytest.skip("tests/serving/conftest.py has no server_process fixture yet")
    http_url, grpc_url = urls

    with tg.InferenceServerClient(_host_port(grpc_url)) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata().name == "rnnserve"
        ready = [m.name for m in client.get_model_repository_index().models if m.state == "READY"]
        lstms = [n for n in ready if client.get_model_metadata(n).inputs[-1].name == "c_0"]
        if not lstms:
            pytest.skip(f"the server_process repository has no ready LSTM model (ready: {ready})")
        name = lstms[0]
        meta = client.get_model_metadata(name)
        features = int(meta.inputs[0].shape[-1])

        x = np.random.default_rng(0).standard_normal((2, 5, features)).astype(np.float32)
        lengths = np.array([5, 3], dtype=np.int32)
        result = client.infer(name, triton_inputs(tg, x, lengths), request_id="e2e")
        assert result.get_response().id == "e2e"
        got = {o: result.as_numpy(o) for o in ("output", "output_last", "h_n", "c_n")}

        with pytest.raises(tg.InferenceServerException) as info:
            client.infer("no-such-model", triton_inputs(tg, x, lengths))
        assert info.value.status() == "StatusCode.NOT_FOUND"
        # tritonclient's class_count asks for classification, which rnnserve refuses rather than ignores
        with pytest.raises(tg.InferenceServerException) as info:
            client.infer(name, triton_inputs(tg, x, lengths), outputs=[tg.InferRequestedOutput("output_last", class_count=2)])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "asks for classification (class_count), which rnnserve does not do" in info.value.message()

    repository = _fixture(request, "model_repository")
    if repository is not None:
        from service import create_engine
        from service.repository import load_model

        expected = create_engine(load_model(f"{repository}/{name}"), "cpu").forward(x, lengths)
        np.testing.assert_allclose(got["output"], expected.output, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["h_n"], expected.h_n, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["c_n"], expected.c_n, rtol=1e-4, atol=1e-5)
    else:
        th = pytest.importorskip("tritonclient.http")
        with th.InferenceServerClient(_host_port(http_url)) as rest:
            via_rest = rest.infer(name, triton_inputs(th, x, lengths))
        for output, value in got.items():
            np.testing.assert_allclose(value, via_rest.as_numpy(output), rtol=1e-6, atol=1e-7)
