"""A client that goes away, and a full queue, against real `rnnserve serve` processes in both layouts.

In one process, a request whose client goes away (gRPC cancel, HTTP connection closed) is
cancelled where it waits, and a stream chunk cancelled before its answer ends its stream (the
client cannot know whether the chunk moved the state). With ``--frontends`` the request waits
in the engine process, so the front-end has to tell it; before it did, a cancelled chunk was
applied and its stream carried on. Likewise ``max_queue_size`` must refuse requests that pile
up in a front-end, not only in the engine process's queue (there each front-end's merged
message counts as one).
"""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.transports.grpc.generated import inference_pb2 as pb
from service.transports.grpc.generated import inference_pb2_grpc as pb_grpc
from service.spec import BlockSpec
from serving_support import make_model, start_server, stop_server

LAYOUTS = {"one process": (), "front-ends": ("--frontends", "2"), "two engines": ("--frontends", "2", "--engines", "2")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, tmp_path_factory):
    repo = tmp_path_factory.mktemp("gone") / "models"
    make_model(BlockSpec("lstm", 4, 128, num_layers=2), seed=3).save(repo, "wide", 1)  # batch 8: ~0.3 s per 10,000 steps (native kernels)
    proc, http_url, grpc_url = start_server(repo, *LAYOUTS[request.param], "--max-queue-size", "4", timeout=120)
    try:
        yield http_url, grpc_url.removeprefix("grpc://"), request.param
    finally:
        assert stop_server(proc) == 0


def _request(x: np.ndarray, sequence_id: int = 0, start: bool = False, end: bool = False,
             model: str = "wide") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.astype(np.float32).tobytes())
    req.outputs.add(name="h_n")
    if sequence_id:
        req.parameters["sequence_id"].int64_param = sequence_id
        req.parameters["sequence_start"].bool_param = start
        req.parameters["sequence_end"].bool_param = end
    return req


def _h_n(resp: pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(resp.raw_output_contents[0], np.float32)


def _busy(stub) -> grpc.Future:
    """A plain request that keeps the engine busy for a while (the chunks after it wait in a queue)."""
    return stub.ModelInfer.future(_request(np.full((8, 60000, 4), 0.1, np.float32)), timeout=120)


def _outcomes(http_url: str) -> dict[str, float]:
    """rnnserve_requests_total of model 'wide' by outcome, from /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{http_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "rnnserve_requests_total" and sample.labels.get("model") == "wide":
                out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0.0) + sample.value
    return out


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if after.get(k, 0.0) != before.get(k, 0.0)}


def _binary_chunk(x: np.ndarray, sequence_id: int) -> tuple[bytes, int]:
    """A stream chunk in the binary tensor extension, and its JSON header's length: a long chunk as JSON took the
    front-end long enough to decode that its client could leave before it reached the engine process."""
    doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                       "parameters": {"binary_data_size": x.nbytes}}],
           "outputs": [{"name": "h_n", "parameters": {"binary_data": False}}], "parameters": {"sequence_id": sequence_id}}
    head = json.dumps(doc).encode()
    return head + x.astype(np.float32).tobytes(), len(head)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_chunk_whose_client_goes_away_ends_its_stream(server, transport):
    http_url, grpc_url, _ = server
    sid = 7001 if transport == "grpc" else 7002
    rng = np.random.default_rng(0)
    # b: long enough (~0.65 s alone on a 2-core CI machine) that it cannot be answered before its client leaves
    # even where the busy requests reach the engine after it (a loaded host); at 3,000 steps that happened once
    a, b, c = (rng.standard_normal((1, n, 4)).astype(np.float32) for n in (5, 100_000, 4))
    before = _outcomes(http_url)
    with grpc.insecure_channel(grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(_request(a, sid, start=True), timeout=30)
        busy = [_busy(stub), _busy(stub)]  # one per engine process where there are two
        time.sleep(0.3)  # the busy requests run: the chunk below waits behind one
        if transport == "grpc":
            gone = stub.ModelInfer.future(_request(b, sid), timeout=60)
            time.sleep(0.3)
            gone.cancel()
        else:
            host, port = http_url.removeprefix("http://").split(":")
            body, head = _binary_chunk(b, sid)
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v2/models/wide/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                             + f"Inference-Header-Content-Length: {head}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                             + body)
                time.sleep(0.3)  # sent and queued; then the client leaves without its answer
        for call in busy:
            call.result(timeout=120)
        time.sleep(0.5)
        # the outcomes add up to the requests sent: the first chunk and the busy ones, and the cancelled chunk
        assert _grown(before, _outcomes(http_url)) == {"success": 3, "cancelled": 1}
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(c, sid, end=True), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
        assert "one of its chunks was cancelled before it was answered" in info.value.details()
        # other streams are not touched, and a new stream of the same id starts afresh
        fresh = stub.ModelInfer(_request(a, sid, start=True, end=True), timeout=30)
        np.testing.assert_array_equal(_h_n(fresh), _h_n(stub.ModelInfer(_request(a), timeout=30)))
        metrics = httpx.get(f"{http_url}/metrics", timeout=10).text
    depth = [line for line in metrics.splitlines() if line.startswith("rnnserve_queue_depth{") and 'model="wide"' in line]
    assert depth and all(line.endswith(" 0.0") for line in depth), depth


def test_a_full_queue_refuses_at_once_in_every_layout(server):
    """max_queue_size 4: with the engine busy, most of 40 concurrent requests are refused at once with 503 /
    UNAVAILABLE naming the limit; the others are answered right."""
    http_url, grpc_url, layout = server
    if layout == "two engines":
        pytest.skip("each engine process has its own queue; the busy requests hold only one of them")
    x = np.random.default_rng(1).standard_normal((1, 6, 4)).astype(np.float32)
    with grpc.insecure_channel(grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        want = _h_n(stub.ModelInfer(_request(x), timeout=30))
        before = _outcomes(http_url)
        busy = [_busy(stub) for _ in range(2)]
        time.sleep(0.3)
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            calls = [pool.submit(stub.ModelInfer, _request(x), timeout=120) for _ in range(40)]
            outcomes = []
            for call in calls:
                try:
                    outcomes.append(_h_n(call.result()))
                except grpc.RpcError as exc:
                    outcomes.append(exc)
        for fut in busy:
            fut.result(timeout=120)
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    answered = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert len(refused) >= 20, f"{len(refused)} of 40 refused"
    for exc in refused:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE and "(max_queue_size 4); retry later" in exc.details()
    for got in answered:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # batched with others: BLAS sums in another order
    # every refusal is counted, also those of a front-end's own queue, which the engine process never sees
    assert _grown(before, _outcomes(http_url)) == {"success": len(answered) + 2, "unavailable": len(refused)}


def test_a_request_cancelled_while_it_waits_is_counted_as_cancelled(server):
    """gRPC cancels a call whose deadline passes; it was not counted at all (the outcomes did not add up)."""
    http_url, grpc_url, layout = server
    x = np.random.default_rng(2).standard_normal((1, 6, 4)).astype(np.float32)
    with grpc.insecure_channel(grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(_request(x), timeout=30)
        before = _outcomes(http_url)
        busy = [_busy(stub) for _ in range(2 if layout != "two engines" else 4)]
        time.sleep(0.2)  # the busy requests run: the call below waits behind them, and leaves before they end
        # (a request a front-end merged with others before it left is computed and counted with them)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(x), timeout=0.15)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for call in busy:
            call.result(timeout=120)
        time.sleep(0.3)
        assert _grown(before, _outcomes(http_url)) == {"success": len(busy), "cancelled": 1}
