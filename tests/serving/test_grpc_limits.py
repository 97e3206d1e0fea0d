"""gRPC calls in progress are bounded (--max-grpc-calls), against a real server.

Found by a hostile probe: a flood of 4,000 concurrent calls got 884 bare CANCELLED answers from grpc-core
(which a client cannot tell from its own cancel), and nothing bounded the calls, or the partial messages, a
process held.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from service.spec import BlockSpec
from service.transports.grpc.generated import inference_pb2 as pb
from service.transports.grpc.generated import inference_pb2_grpc as pb_grpc
from serving_support import make_model, start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("calls") / "models"
    make_model(BlockSpec("lstm", 4, 64), seed=3).save(repo, "m", 1)
    proc, _, grpc_url = start_server(repo, "--max-grpc-calls", "3")
    try:
        yield grpc_url.removeprefix("grpc://")
    finally:
        assert stop_server(proc) == 0


def _request(steps: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    x = np.full((1, steps, 4), 0.1, np.float32)
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    req.outputs.add(name="h_n")
    return req


def test_calls_past_the_limit_are_refused_with_resource_exhausted_and_the_rest_answered(server):
    with grpc.insecure_channel(server) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        want = np.frombuffer(stub.ModelInfer(_request(50_000), timeout=60).raw_output_contents[0], np.float32)
        calls = [stub.ModelInfer.future(_request(50_000), timeout=60) for _ in range(12)]
        answered, refused = 0, 0
        for call in calls:
            try:
                got = np.frombuffer(call.result().raw_output_contents[0], np.float32)
                np.testing.assert_array_equal(got, want)
                answered += 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                assert "Concurrent RPC limit exceeded" in exc.details()
                refused += 1
        assert answered >= 1 and refused >= 1 and answered + refused == 12
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
