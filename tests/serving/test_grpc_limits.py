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

from service.spec import BlockSpec
from service.transports.grpc.limits import GrpcLimits
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


def test_the_limits_become_grpc_core_arguments_and_the_log_states_the_worst_case():
    limits = GrpcLimits.of(4096, 0, 5.0)
    options = dict(limits.options())
    assert options["grpc.server_handshake_timeout_ms"] == 5000 and options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.max_allowed_incoming_connections"] == limits.max_connections >= 16
    assert "could hold 256 GiB" in limits.describe(64 * MIB)
    assert GrpcLimits.of(7, 9, 0.0) == GrpcLimits(7, 9, 0.0)


@pytest.mark.asyncio
async def test_a_connection_with_no_call_is_closed_after_the_idle_time():
    """Connections that finished their handshake and then sent nothing were kept for good, and filled the
    connection cap (a probe: 32 of 32 held for 150 s, every other client refused)."""
    import asyncio

    from service.transports.grpc import create_grpc_server

    server = create_grpc_server(object(), "127.0.0.1", 0, limits=GrpcLimits(idle_s=0.5))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 5)
            deadline = asyncio.get_running_loop().time() + 10
            while channel.get_state() == grpc.ChannelConnectivity.READY:
                assert asyncio.get_running_loop().time() < deadline, "the idle connection was kept"
                await asyncio.sleep(0.1)
            assert channel.get_state() in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING,
                                           grpc.ChannelConnectivity.TRANSIENT_FAILURE)
    finally:
        await server.stop(None)


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
    assert any("gRPC limits: 4,096 calls in progress, 3 connections" in line for line in lines), lines


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value  # literal, not indexed, no Huffman


def test_malformed_grpc_headers_on_end_do_not_flood_the_log(tmp_path):
    """grpc-core logged an error line for each connection whose call carried an unparsable grpc-timeout (a probe:
    530 kB of log a second); its own log is off unless asked for (GRPC_VERBOSITY, or --log-level debug)."""
    import struct

    repo = tmp_path / "models"
    make_model(BlockSpec("lstm", 4, 8), seed=1).save(repo, "m", 1)
    lines: list[str] = []
    proc, _, grpc_url = start_server(repo, output=lines)
    try:
        host, port = grpc_url.removeprefix("grpc://").rsplit(":", 1)
        block = b"".join(_hpack_literal(n, v) for n, v in (
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/inference.GRPCInferenceService/ServerLive"),
            (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
            (b"grpc-timeout", b"abc")))
        frames = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + b"\x04\x00" + struct.pack(">I", 0)
                  + struct.pack(">I", len(block))[1:] + b"\x01\x05" + struct.pack(">I", 1) + block)
        for _ in range(50):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(frames)
                sock.settimeout(2)
                try:
                    sock.recv(4096)
                except OSError:
                    pass
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            assert pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live
        time.sleep(0.5)
    finally:
        assert stop_server(proc) == 0
    assert not [line for line in lines if "grpc-timeout" in line or "hpack" in line], lines[-5:]
