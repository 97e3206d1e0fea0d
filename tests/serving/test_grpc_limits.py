"""gRPC calls and connections are bounded (--max-grpc-calls, --max-grpc-connections), against a real server.

Found by hostile probes: a flood of 4,000 concurrent calls got 884 bare CANCELLED answers from grpc-core
(which a client cannot tell from its own cancel), and nothing bounded the calls, the partial messages they
buffer (up to --max-request-bytes each), or the connections a process held (idle ones took every file
descriptor).
"""
from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest

from service.host_memory import host_memory_bytes
from service.spec import BlockSpec
from service.transports.grpc.limits import GrpcLimits, auto_call_cap
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
                # bit for bit on the compiled CPU kernels; NumPy's fallback (a host with no C compiler) sums in
                # another order for other batch sizes, ~1.5e-5 apart after 50,000 steps (an H100 host)
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
                answered += 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                assert "Concurrent RPC limit exceeded" in exc.details()
                refused += 1
        assert answered >= 1 and refused >= 1 and answered + refused == 12
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live


GIB, MIB = 1 << 30, 1 << 20


def test_the_automatic_call_limit_keeps_partial_messages_within_half_the_memory():
    assert auto_call_cap(64 * MIB, 1, memory_bytes=24 * GIB) == 192       # 12 GiB / 64 MiB
    assert auto_call_cap(64 * MIB, 8, memory_bytes=128 * GIB) == 128      # 64 GiB / 64 MiB / 8 front-ends
    assert auto_call_cap(1 * MIB, 1, memory_bytes=128 * GIB) == 4096      # at most 4,096
    assert auto_call_cap(2 * GIB - 1, 1, memory_bytes=16 * GIB) == 64     # at least 64
    limits = GrpcLimits.of(0, 0, 5.0, 64 * MIB, 2)
    assert 64 <= limits.max_calls <= 4096 and limits.max_connections >= 16
    assert dict(limits.options())["grpc.server_handshake_timeout_ms"] == 5000
    assert GrpcLimits.of(7, 9, 0.0, 64 * MIB, 1) == GrpcLimits(7, 9, 0.0)


def _held(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock`` open (whatever bytes it sent, as long as it has not closed it)."""
    sock.setblocking(False)
    try:
        while True:
            if sock.recv(65536) == b"":
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_connections_past_the_limit_and_silent_ones_are_closed_and_clients_then_served(tmp_path):
    repo = tmp_path / "models"
    make_model(BlockSpec("lstm", 4, 8), seed=1).save(repo, "m", 1)
    lines: list[str] = []
    proc, _, grpc_url = start_server(repo, "--max-grpc-connections", "3", "--body-timeout-s", "2", output=lines)
    try:
        host, port = grpc_url.removeprefix("grpc://").rsplit(":", 1)
        silent = [socket.create_connection((host, int(port))) for _ in range(6)]
        time.sleep(0.5)
        held = [_held(s) for s in silent]
        assert held.count(True) == 3, held       # the first three wait for their handshake, the rest are closed
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=1)
            assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        deadline = time.monotonic() + 10
        while any(_held(s) for s in silent) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_held(s) for s in silent)  # no preface within --body-timeout-s: closed
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            assert pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live
        for s in silent:
            s.close()
    finally:
        assert stop_server(proc) == 0
    assert any("gRPC limits:" in line and "3 connections" in line for line in lines), lines


def test_front_ends_share_the_automatic_call_limit(tmp_path):
    """Each front-end runs with the settings of one process; its automatic limit must still be its share."""
    repo = tmp_path / "models"
    make_model(BlockSpec("lstm", 4, 8), seed=1).save(repo, "m", 1)
    lines: list[str] = []
    size = host_memory_bytes() // 2 // 1000   # one process would take 1,000 calls; each of two, 500
    proc, _, _ = start_server(repo, "--frontends", "2", "--max-request-bytes", str(size), output=lines)
    assert stop_server(proc) == 0
    want = f"gRPC limits: {auto_call_cap(size, 2):,} calls in progress"
    assert auto_call_cap(size, 2) == 500
    assert sum(want in line for line in lines) == 2, [line for line in lines if "gRPC limits" in line]
