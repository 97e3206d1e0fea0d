"""The gRPC transport over the real DataPlane (CPU reference engine), in process.

A tiny random LSTM is saved to a temporary repository; ``tritonclient.grpc`` talks
to a real grpc.aio server on a free port; answers must equal the reference engine's.
"""
from __future__ import annotations

import asyncio
import queue
import threading

import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from service import create_engine
from service.dataplane import DataPlane
from service.packing import block_param_count
from service.registry import ModelRegistry
from service.repository import PackedModel
from service.spec import BlockSpec, RNNSpec
from service.transports.grpc import create_grpc_server
from serving_support import triton_inputs

SPEC = RNNSpec((BlockSpec("lstm", 3, 5, 2, False, 0),))
LIMIT = 256 * 1024  # the server's gRPC message limit in these tests


def _model() -> PackedModel:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(block_param_count(SPEC.blocks[0])) * 0.3).astype(np.float32)
    return PackedModel(SPEC, [weights])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("models")
    model = _model()
    model.save(repo, "lstm")
    dataplane = DataPlane(ModelRegistry(repo, device="cpu"))

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)

    async def start():
        await dataplane.start()
        server = create_grpc_server(dataplane, "127.0.0.1", 0, max_message_bytes=LIMIT)
        await server.start()
        return server

    server = call(start())
    try:
        yield f"127.0.0.1:{server.bound_port}", create_engine(model, "cpu")
    finally:
        call(server.stop(0))
        call(dataplane.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def test_infer_matches_reference_engine(served):
    url, engine = served
    x = np.random.default_rng(1).standard_normal((3, 6, 3)).astype(np.float32)
    lengths = np.array([6, 2, 4], dtype=np.int32)
    expected = engine.forward(x, lengths)
    with tg.InferenceServerClient(url) as client:
        assert client.is_server_ready() and client.is_model_ready("lstm")
        # unknown model or version: not ready, as Triton answers (it used to be a NOT_FOUND error)
        assert client.is_model_ready("nope") is False and client.is_model_ready("lstm", "9") is False
        meta = client.get_model_metadata("lstm", as_json=True)
        assert [t["name"] for t in meta["inputs"]] == ["input", "lengths", "h_0", "c_0"]
        result = client.infer("lstm", triton_inputs(tg, x, lengths), request_id="q1")
    assert result.get_response().id == "q1"
    np.testing.assert_allclose(result.as_numpy("output"), expected.output, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("h_n"), expected.h_n, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("c_n"), expected.c_n, rtol=1e-5, atol=1e-6)


def test_stream_and_errors_through_real_dataplane(served):
    url, engine = served
    x = np.random.default_rng(2).standard_normal((1, 4, 3)).astype(np.float32)
    wrong = np.zeros((1, 4, 7), dtype=np.float32)
    results: queue.Queue = queue.Queue()
    with tg.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=30)
        for arr in (x, wrong, x):
            client.async_stream_infer("lstm", triton_inputs(tg, arr, np.array([4], dtype=np.int32)),
                                      outputs=[tg.InferRequestedOutput("output_last")])
        got = [results.get(timeout=30) for _ in range(3)]
        client.stop_stream()

        with pytest.raises(InferenceServerException) as info:
            client.infer("nope", triton_inputs(tg, x, np.array([4], dtype=np.int32)))
        assert info.value.status() == "StatusCode.NOT_FOUND"
        assert "unknown model 'nope'" in info.value.message()

        twice = [tg.InferRequestedOutput("h_n"), tg.InferRequestedOutput("h_n")]
        with pytest.raises(InferenceServerException) as info:
            client.infer("lstm", triton_inputs(tg, x, np.array([4], dtype=np.int32)), outputs=twice)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message() == "output 'h_n' is requested twice; ask for each output once"

    expected = engine.forward(x, np.array([4])).output[:, -1]
    for i in (0, 2):
        result, error = got[i]
        assert error is None
        assert [o.name for o in result.get_response().outputs] == ["output_last"]
        np.testing.assert_allclose(result.as_numpy("output_last"), expected, rtol=1e-5, atol=1e-6)
    assert got[1][0] is None
    assert got[1][1].message() == "input 'input' has 7 features, model 'lstm' expects 3"


def test_an_answer_over_the_message_limit_says_what_to_change(served):
    url, engine = served
    x = np.random.default_rng(3).standard_normal((1, 15000, 3)).astype(np.float32)  # 180 KB in, 300 KB of output
    lengths = np.array([15000], dtype=np.int32)
    with tg.InferenceServerClient(url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer("lstm", triton_inputs(tg, x, lengths), outputs=[tg.InferRequestedOutput("output")])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert f"over the server's gRPC message limit of {LIMIT:,} bytes" in info.value.message()
        assert "(output: 75,000 numbers)" in info.value.message()
        assert "output_last instead of output" in info.value.message()

        # tensors within the limit, the whole message over it by its names and shapes: refused before it runs
        x_edge = x[:, :13107]  # output: 65,535 numbers, 262,140 bytes
        with pytest.raises(InferenceServerException) as info:
            client.infer("lstm", triton_inputs(tg, x_edge, np.array([13107], np.int32)),
                         outputs=[tg.InferRequestedOutput("output")])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert f"would take about 262,656 bytes (output: 65,535 numbers), over the server's gRPC message limit of " \
               f"{LIMIT:,} bytes" in info.value.message()
        fits = client.infer("lstm", triton_inputs(tg, x[:, :13000], np.array([13000], np.int32)),
                            outputs=[tg.InferRequestedOutput("output")])
        np.testing.assert_allclose(fits.as_numpy("output"), engine.forward(x[:, :13000]).output, rtol=1e-5, atol=1e-6)

        # the answer repeats the request's id: a long id takes it over the limit, refused before it runs
        id_edge = "i" * (LIMIT - 13000 * 20 - 300)
        with pytest.raises(InferenceServerException) as info:
            client.infer("lstm", triton_inputs(tg, x[:, :13000], np.array([13000], np.int32)), request_id=id_edge,
                         outputs=[tg.InferRequestedOutput("output")])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "would take about" in info.value.message()

        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=30)
        client.async_stream_infer("lstm", triton_inputs(tg, x, lengths), outputs=[tg.InferRequestedOutput("output")])
        client.async_stream_infer("lstm", triton_inputs(tg, x, lengths),
                                  outputs=[tg.InferRequestedOutput("output_last")])
        (_, too_large), (last, error) = results.get(timeout=60), results.get(timeout=60)
        client.stop_stream()
        assert "over the server's gRPC message limit" in too_large.message() and error is None
        expected = engine.forward(x, lengths).output[:, -1]
        np.testing.assert_allclose(last.as_numpy("output_last"), expected, rtol=1e-5, atol=1e-6)
