"""The gRPC transport against a real grpc.aio server on a free port, over a fake DataPlane.

Clients: the real ``tritonclient.grpc`` (what users run) and raw stubs of our own
generated code (for what tritonclient cannot send: typed contents, bad sizes).
The server runs on its own event loop in a thread, so the tests are plain sync code.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.dataplane.types import DATATYPES, InferResponse, InferTensor, datatype_of
from service.errors import DeadlineExceeded, InvalidInput, NotFound, Unavailable
from service.transports.grpc import create_grpc_server
from service.transports.grpc.generated import inference_pb2 as pb
from service.transports.grpc.generated import inference_pb2_grpc as pb_grpc

# --------------------------------------------------------------------------- fake


class FakeDataPlane:
    """The DataPlane interface with canned answers.

    Model ``double`` returns ``output`` = 2 * ``input`` and ``output_last`` =
    ``input[:, -1]``, honouring the requested outputs; request parameter
    ``delay_ms`` makes it sleep first. Models named in ``FAILURES`` raise that error.
    """

    FAILURES = {
        "bad": InvalidInput("input 'input' has 3 features, model 'bad' expects 40"),
        "busy": Unavailable("model 'busy' queue is full; retry later"),
        "slowpoke": DeadlineExceeded("request timed out after 5 ms in the queue"),
        "crash": RuntimeError("kaboom"),
    }

    def __init__(self) -> None:
        self.is_ready = True
        self.requests = []
        self.started: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.metadata_fails = False
        self.ended_streams: list[tuple] = []

    async def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        return self.is_ready

    async def server_metadata(self) -> dict:
        if self.metadata_fails:
            raise KeyError("version")
        return {"name": "rnnserve", "version": "0.1.0", "extensions": ["model_repository", "sequence"]}

    def _known(self, name: str) -> None:
        if name != "double" and name not in self.FAILURES:
            raise NotFound(f"model '{name}' is not in the repository")

    async def model_metadata(self, name: str, version: str = "") -> dict:
        self._known(name)
        return {
            "name": name,
            "versions": ["1"],
            "platform": "rnnserve_reference",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, -1, 3]}],
            "outputs": [
                {"name": "output", "datatype": "FP32", "shape": [-1, -1, 3]},
                {"name": "output_last", "datatype": "FP32", "shape": [-1, 3]},
            ],
        }

    async def model_ready(self, name: str, version: str = "") -> bool:
        self._known(name)
        return name == "double"

    async def infer(self, request):
        self.requests.append(request)
        self._known(request.model_name)
        if request.model_name in self.FAILURES:
            raise self.FAILURES[request.model_name]
        self.started.append(request.id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(request.parameters.get("delay_ms", 0) / 1000)
        finally:
            self.in_flight -= 1
        x = request.inputs[0].data
        produced = {"output": x * 2, "output_last": x[:, -1]}
        wanted = [o.name for o in request.outputs] if request.outputs else list(produced)
        return InferResponse(
            model_name=request.model_name,
            model_version="1",
            id=request.id,
            outputs=[
                InferTensor(name=n, datatype=datatype_of(produced[n]), shape=list(produced[n].shape), data=produced[n])
                for n in wanted
            ],
        )

    async def end_stream(self, model: str, version: str, parameters: dict, why: str, caller: int) -> None:
        self.ended_streams.append((model, version, parameters.get("sequence_id"), why, caller))

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        models = [
            {"name": "double", "version": "1", "state": "READY", "reason": ""},
            {"name": "busy", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"},
        ]
        return [m for m in models if m["state"] == "READY"] if ready_only else models

    async def load_model(self, name: str) -> None:
        self._known(name)
        self.loaded.append(name)

    async def unload_model(self, name: str) -> None:
        self._known(name)
        self.unloaded.append(name)


# ------------------------------------------------------------------------ fixtures


class ServerThread:
    """A started gRPC server on its own event loop in a daemon thread."""

    def __init__(self, dataplane, **options) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self._call(self._start(dataplane, options))
        self.url = f"127.0.0.1:{self.server.bound_port}"

    async def _start(self, dataplane, options):
        server = create_grpc_server(dataplane, "127.0.0.1", 0, **options)
        await server.start()
        return server

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def close(self) -> None:
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture(scope="module")
def dataplane():
    return FakeDataPlane()


@pytest.fixture(scope="module")
def server(dataplane):
    srv = ServerThread(dataplane)
    yield srv
    srv.close()


@pytest.fixture
def fresh(dataplane):
    """The shared fake with its request log emptied and ready restored."""
    dataplane.requests.clear()
    dataplane.started.clear()
    dataplane.max_in_flight = 0
    dataplane.is_ready = True
    dataplane.metadata_fails = False
    dataplane.ended_streams.clear()
    return dataplane


@pytest.fixture
def client(server):
    c = tg.InferenceServerClient(server.url)
    yield c
    c.close()


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.url) as ch:
        yield ch


@pytest.fixture
def stub(channel):
    return pb_grpc.GRPCInferenceServiceStub(channel)


def _x(shape=(2, 4, 3), dtype=np.float32) -> np.ndarray:
    return np.arange(np.prod(shape)).reshape(shape).astype(dtype)


def _triton_input(x: np.ndarray, name: str = "input") -> tg.InferInput:
    inp = tg.InferInput(name, list(x.shape), datatype_of(x))
    inp.set_data_from_numpy(x)
    return inp


def _rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


# ------------------------------------------------------------- health and metadata


def test_live_ready_and_health_follow_dataplane(client, channel, fresh):
    health = health_pb2_grpc.HealthStub(channel)
    assert client.is_server_live() and client.is_server_ready()
    for service in ("", "inference.GRPCInferenceService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    fresh.is_ready = False
    assert not client.is_server_ready()
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

    err = _rpc_error(health.Check, health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_sees_readiness_change(channel, fresh):
    health = health_pb2_grpc.HealthStub(channel)
    stream = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    fresh.is_ready = False
    assert next(stream).status == health_pb2.HealthCheckResponse.NOT_SERVING
    stream.cancel()


def test_server_and_model_metadata(client, fresh):
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "rnnserve" and meta["version"] == "0.1.0"
    assert meta["extensions"] == ["model_repository", "sequence"]

    model = client.get_model_metadata("double", as_json=True)
    assert model["name"] == "double" and model["versions"] == ["1"]
    assert model["platform"] == "rnnserve_reference"
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "-1", "3"]}]
    assert [o["name"] for o in model["outputs"]] == ["output", "output_last"]


def test_model_ready(client, fresh):
    assert client.is_model_ready("double")
    assert not client.is_model_ready("busy")
    # as Triton: an unknown model is not ready (OK, ready=false), not an error a polling client must catch
    assert client.is_model_ready("nope") is False


# -------------------------------------------------------------------------- infer


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.int32, np.uint8])
def test_infer_raw_roundtrip_through_tritonclient(client, fresh, dtype):
    x = _x(dtype=dtype)
    result = client.infer("double", [_triton_input(x)], request_id="req-1")
    np.testing.assert_array_equal(result.as_numpy("output"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("output_last"), x[:, -1])
    response = result.get_response()
    assert response.model_name == "double" and response.model_version == "1" and response.id == "req-1"
    assert [o.datatype for o in response.outputs] == [datatype_of(x)] * 2

    seen = fresh.requests[-1].inputs[0]
    assert (seen.name, seen.datatype, seen.shape) == ("input", datatype_of(x), [2, 4, 3])
    assert seen.data.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(seen.data, x)
    assert fresh.requests[-1].outputs is None


def test_requested_outputs_reach_dataplane(client, fresh):
    x = _x()
    wanted = tg.InferRequestedOutput("output_last")
    result = client.infer("double", [_triton_input(x)], outputs=[wanted])
    assert [o.name for o in result.get_response().outputs] == ["output_last"]
    assert result.as_numpy("output") is None
    assert [o.name for o in fresh.requests[-1].outputs] == ["output_last"]


def test_sequence_and_scheduling_parameters_reach_dataplane(client, fresh):
    client.infer(
        "double", [_triton_input(_x())], sequence_id=42, sequence_start=True, sequence_end=False,
        priority=3, timeout=5000, parameters={"delay_ms": 0, "note": "hi"},
    )
    params = fresh.requests[-1].parameters
    assert params["sequence_id"] == 42
    assert params["sequence_start"] is True and params["sequence_end"] is False
    assert params["priority"] == 3 and params["timeout"] == 5000
    assert params["note"] == "hi"

    client.infer("double", [_triton_input(_x())], sequence_id="user-7", sequence_end=True)
    params = fresh.requests[-1].parameters
    assert params["sequence_id"] == "user-7" and params["sequence_end"] is True


def test_uint64_sequence_id_and_double_parameter(stub, fresh):
    x = _x()
    request = pb.ModelInferRequest(model_name="double", raw_input_contents=[x.tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=x.shape)
    request.parameters["sequence_id"].uint64_param = 2**64 - 1
    request.parameters["scale"].double_param = 0.25
    stub.ModelInfer(request, timeout=5)
    params = fresh.requests[-1].parameters
    assert params["sequence_id"] == 2**64 - 1 and params["scale"] == 0.25


@pytest.mark.parametrize(
    "datatype, field, values, dtype",
    [
        ("FP32", "fp32_contents", [0.5, -1.0, 2.25, 3.0], np.float32),
        ("FP64", "fp64_contents", [0.1, 0.2, 0.3, 0.4], np.float64),
        ("INT64", "int64_contents", [1, -2, 3, -(2**40)], np.int64),
        ("INT32", "int_contents", [1, -2, 3, 4], np.int32),
        ("UINT8", "uint_contents", [0, 1, 254, 255], np.uint8),
        ("BOOL", "bool_contents", [True, False, True, True], np.bool_),
    ],
)
def test_typed_contents(stub, fresh, datatype, field, values, dtype):
    request = pb.ModelInferRequest(model_name="double")
    tensor = request.inputs.add(name="input", datatype=datatype, shape=[1, 2, 2])
    getattr(tensor.contents, field).extend(values)
    response = stub.ModelInfer(request, timeout=5)

    seen = fresh.requests[-1].inputs[0].data
    assert seen.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(seen, np.array(values, dtype=dtype).reshape(1, 2, 2))
    # Responses always carry raw contents, never typed ones.
    assert len(response.raw_output_contents) == 2
    assert not response.outputs[0].HasField("contents")
    out_dtype = DATATYPES[response.outputs[0].datatype].newbyteorder("<")
    out = np.frombuffer(response.raw_output_contents[0], dtype=out_dtype)
    np.testing.assert_array_equal(out.reshape(response.outputs[0].shape), seen * 2)


def _raw_request(x: np.ndarray, raw: list[bytes] | None = None, datatype: str | None = None, shape=None):
    request = pb.ModelInferRequest(model_name="double")
    request.inputs.add(name="input", datatype=datatype or datatype_of(x), shape=shape or list(x.shape))
    request.raw_input_contents.extend([x.tobytes()] if raw is None else raw)
    return request


BAD_REQUESTS = {
    "raw too short": (
        lambda x: _raw_request(x, raw=[x.tobytes()[:-4]]),
        "input 'input' has 92 bytes of raw data, but shape [2, 4, 3] of FP32 needs 96 bytes",
    ),
    "raw too long": (
        lambda x: _raw_request(x, raw=[x.tobytes() + b"\0" * 4]),
        "input 'input' has 100 bytes of raw data, but shape [2, 4, 3] of FP32 needs 96 bytes",
    ),
    "raw sized for another dtype": (
        lambda x: _raw_request(x, datatype="FP64"),
        "input 'input' has 96 bytes of raw data, but shape [2, 4, 3] of FP64 needs 192 bytes",
    ),
    "more raw entries than inputs": (
        lambda x: _raw_request(x, raw=[x.tobytes(), x.tobytes()]),
        "request has 1 inputs but 2 raw_input_contents",
    ),
    "negative dimension": (
        lambda x: _raw_request(x, shape=[2, -4, 3]),
        "input 'input' has shape [2, -4, 3]; every dimension must be >= 0",
    ),
    "unsupported datatype": (
        lambda x: _raw_request(x, datatype="BYTES"),
        "datatype 'BYTES' is not supported",
    ),
    "65 dimensions (NumPy's limit is 64: was INTERNAL)": (
        lambda x: _raw_request(x, shape=[1] * 65, raw=[b"\0" * 4]),
        "input 'input' has 65 dimensions; rnnserve's tensors have 1 to 3",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_raw_requests_are_invalid_argument(stub, fresh, case):
    build, message = BAD_REQUESTS[case]
    err = _rpc_error(stub.ModelInfer, build(_x()), timeout=5)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()
    assert fresh.requests == []  # rejected before the dataplane


def _typed(datatype: str, shape, **contents) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="double")
    tensor = request.inputs.add(name="input", datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return request


def test_bad_typed_requests_are_invalid_argument(stub, fresh):
    mixed = _typed("FP32", [1, 1, 1], fp32_contents=[1.0])
    mixed.raw_input_contents.append(b"\0" * 4)
    cases = [
        (mixed, "request mixes raw_input_contents with typed contents (input 'input')"),
        (_typed("FP32", [1, 2, 2], fp32_contents=[1.0, 2.0]),
         "input 'input' has 2 values in contents.fp32_contents, but shape [1, 2, 2] needs 4"),
        (_typed("FP32", [1, 1, 2], int64_contents=[1, 2]),
         "input 'input' is FP32, so its data goes in contents.fp32_contents; got contents.int64_contents"),
        (_typed("FP16", [1, 1, 1], fp32_contents=[1.0]),
         "input 'input' is FP16, which has no typed contents field; send it in raw_input_contents"),
        (_typed("FP32", [1, 1, 3]), "input 'input' has no data"),
        (_typed("UINT8", [1, 1, 1], uint_contents=[300]),
         "input 'input' has a value in contents.uint_contents out of range for UINT8"),
    ]
    for request, message in cases:
        err = _rpc_error(stub.ModelInfer, request, timeout=5)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in err.details()
    assert fresh.requests == []


# ------------------------------------------------------------------ error mapping


@pytest.mark.parametrize(
    "model, code, message",
    [
        ("nope", grpc.StatusCode.NOT_FOUND, "model 'nope' is not in the repository"),
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "input 'input' has 3 features, model 'bad' expects 40"),
        ("busy", grpc.StatusCode.UNAVAILABLE, "model 'busy' queue is full; retry later"),
        ("slowpoke", grpc.StatusCode.DEADLINE_EXCEEDED, "request timed out after 5 ms in the queue"),
        ("crash", grpc.StatusCode.INTERNAL, "internal error: RuntimeError: kaboom"),
    ],
)
def test_errors_map_to_grpc_codes(client, stub, fresh, model, code, message):
    x = _x()
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [_triton_input(x)])
    assert info.value.status() == str(code)
    assert info.value.message() == message

    err = _rpc_error(stub.ModelInfer, pb.ModelInferRequest(
        model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=x.shape)],
        raw_input_contents=[x.tobytes()]), timeout=5)
    assert (err.code(), err.details()) == (code, message)


def test_unexpected_error_outside_infer_is_internal(client, fresh):
    fresh.metadata_fails = True
    with pytest.raises(InferenceServerException) as info:
        client.get_server_metadata(client_timeout=5)
    assert info.value.status() == "StatusCode.INTERNAL"
    assert info.value.message() == "internal error: KeyError: 'version'"


def test_an_error_repeating_a_huge_name_keeps_its_status(stub, fresh):
    """grpc-core refuses a status message past 16 KiB (sometimes 8 KiB) with its own RESOURCE_EXHAUSTED; an
    error that repeats a 17,000-character model name is cut so that the client gets NOT_FOUND."""
    for name in ("m" * 17000, "é" * 9000):
        err = _rpc_error(stub.ModelMetadata, pb.ModelMetadataRequest(name=name), timeout=5)
        assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
        assert "bytes of the message cut ...]" in err.details() and err.details().endswith("is not in the repository")
        assert len(err.details().encode()) <= 2000


def test_rpcs_we_do_not_serve_are_unimplemented(client):
    for call in (client.get_system_shared_memory_status, client.get_cuda_shared_memory_status,
                 client.get_trace_settings, client.get_log_settings):
        with pytest.raises(InferenceServerException) as info:
            call(client_timeout=5)
        assert info.value.status() == "StatusCode.UNIMPLEMENTED", call.__name__


def test_message_size_limit():
    srv = ServerThread(FakeDataPlane(), max_message_bytes=4096)
    try:
        with tg.InferenceServerClient(srv.url) as c:
            with pytest.raises(InferenceServerException) as info:
                c.infer("double", [_triton_input(_x((1, 100, 20)))], client_timeout=5)
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            c.infer("double", [_triton_input(_x((1, 10, 3)))], client_timeout=5)
    finally:
        srv.close()


def test_a_stream_error_too_long_to_echo_answers_without_the_echo_and_the_call_goes_on():
    # an error reply repeats the request's id and model name; near the message limit that reply was over it,
    # and grpc ended the whole call: later requests got no answer
    srv = ServerThread(FakeDataPlane(), max_message_bytes=4096)
    try:
        with grpc.insecure_channel(srv.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            long_id = _stream_request(0, model="bad")
            long_id.id = "i" * 3900
            replies = list(stub.ModelStreamInfer(iter([long_id, _stream_request(1)]), timeout=10))
        assert replies[0].error_message == ("input 'input' has 3 features, model 'bad' expects 40 (this request's "
                                            "id and model name are too long to repeat within the message limit)")
        assert not replies[1].error_message and replies[1].infer_response.id == "s1"
    finally:
        srv.close()


# ------------------------------------------------------------------------ stream


def test_triton_s_final_response_flag_must_be_a_boolean(stub, fresh):
    # a string "true" was silently ignored; checked before the request runs, as sequence_start is
    request = _stream_request(0)
    request.parameters["triton_enable_empty_final_response"].string_param = "true"
    (reply,) = list(stub.ModelStreamInfer(iter([request]), timeout=10))
    assert reply.error_message == ("parameter 'triton_enable_empty_final_response' must be true or false "
                                   "(bool_param), got string 'true'")
    assert fresh.started == []


def test_stream_through_tritonclient_keeps_order_and_survives_an_error(client, fresh):
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=30)
    try:
        for i in range(5):
            model = "bad" if i == 2 else "double"
            x = _x() + i
            client.async_stream_infer(
                model, [_triton_input(x)], request_id=f"r{i}",
                # earlier requests take longer: order must come from the server, not timing
                parameters={"delay_ms": 50 * (4 - i)},
            )
        got = [results.get(timeout=10) for _ in range(5)]
    finally:
        client.stop_stream()

    for i, (result, error) in enumerate(got):
        if i == 2:
            assert result is None
            assert "input 'input' has 3 features, model 'bad' expects 40" in error.message()
        else:
            assert error is None
            assert result.get_response().id == f"r{i}"
            np.testing.assert_array_equal(result.as_numpy("output"), (_x() + i) * 2)
    # Independent requests of one stream overlap in the dataplane (so they can batch).
    assert fresh.max_in_flight > 1


def test_a_stream_opened_with_triton_grpc_error_ends_with_the_failed_request_s_status(client, fresh):
    """Triton's header ``triton_grpc_error: true``: a failed request ends the stream with its gRPC status, and later
    requests are not run. It was ignored: the error came back inside the stream with no status, the stream went on."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=30,
                        headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("double", [_triton_input(_x())], request_id="r0")
        assert results.get(timeout=10)[1] is None
        client.async_stream_infer("bad", [_triton_input(_x())], request_id="r1")
        result, error = results.get(timeout=10)
        assert result is None and error.status() == "StatusCode.INVALID_ARGUMENT", error
        assert "input 'input' has 3 features, model 'bad' expects 40" in error.message()
        with pytest.raises(InferenceServerException, match="The stream is no longer in valid state"):
            client.async_stream_infer("double", [_triton_input(_x() + 1)], request_id="r2")
    finally:
        client.stop_stream()
    assert "r2" not in fresh.started


def test_with_triton_grpc_error_requests_after_a_failed_one_get_no_answer(stub, fresh):
    replies = []
    requests = [_stream_request(0), _stream_request(1, model="bad"), _stream_request(2, delay_ms=200)]
    with pytest.raises(grpc.RpcError) as info:
        for reply in stub.ModelStreamInfer(iter(requests), timeout=10, metadata=(("triton_grpc_error", "true"),)):
            replies.append(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.infer_response.id for r in replies] == ["s0"]
    # without the header the stream answers all three
    assert [r.infer_response.id for r in stub.ModelStreamInfer(iter(requests), timeout=10)] == ["s0", "s1", "s2"]


def test_with_triton_grpc_error_a_stream_moved_behind_the_failed_request_is_ended_before_the_status(stub, fresh):
    """The chunk of sequence 9 runs beside the failed request. It was cancelled as the call ended; a cancel that
    landed after the engine moved the stream left it moved, its answer lost and the stream live: the client, told
    the call failed, resent the chunk and it was applied twice. Now it finishes, and its stream is ended before the
    status reaches the client."""
    # s0 is slow, so that all three are read and running before the failure's turn comes (answers go in order)
    requests = [_stream_request(0, delay_ms=100), _stream_request(1, model="bad"),
                _stream_request(2, delay_ms=250, sequence_id=9)]
    replies = []
    with pytest.raises(grpc.RpcError) as info:
        for reply in stub.ModelStreamInfer(iter(requests), timeout=10, metadata=(("triton_grpc_error", "true"),)):
            replies.append(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(replies) == 1
    assert "s2" in fresh.started and fresh.in_flight == 0  # ran to its end, not cancelled
    assert [(model, sequence) for model, _, sequence, _, _ in fresh.ended_streams] == [("double", 9)]


def test_with_triton_grpc_error_a_chunk_still_running_when_the_client_cancels_is_cancelled(stub, fresh):
    """The client cancels while the call waits for the chunks running beside the failed request: the chunk being
    waited for had been taken out of the call's queue, so the call's cleanup never saw it; it ran on, moved its
    stream, and nothing ended it (a resent chunk was applied twice). Now it is cancelled (which ends its stream in
    the dataplane)."""
    requests = [_stream_request(0, delay_ms=100), _stream_request(1, model="bad"),
                _stream_request(2, delay_ms=3000, sequence_id=9)]
    call = stub.ModelStreamInfer(iter(requests), timeout=10, metadata=(("triton_grpc_error", "true"),))
    assert next(call).infer_response.id == "s0"  # then the failure's turn: the call waits for s2
    time.sleep(0.3)
    call.cancel()
    deadline = time.monotonic() + 2
    while fresh.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "s2" in fresh.started and fresh.in_flight == 0, "the running chunk was left to run on"


def _stream_request(i: int, model: str = "double", delay_ms: int = 0, sequence_id=None, final=False):
    x = _x((1, 2, 3)) + i
    request = _raw_request(x)
    request.model_name = model
    request.id = f"s{i}"
    request.parameters["delay_ms"].int64_param = delay_ms
    if sequence_id is not None:
        request.parameters["sequence_id"].int64_param = sequence_id
    if final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def test_raw_stream_errors_carry_request_identity(stub, fresh):
    requests = [_stream_request(0), _stream_request(1, model="nope"), _stream_request(2, model="crash"),
                _stream_request(3, final=True)]
    replies = list(stub.ModelStreamInfer(iter(requests), timeout=10))
    assert [r.error_message for r in replies] == [
        "", "model 'nope' is not in the repository", "internal error: RuntimeError: kaboom", "",
    ]
    assert [r.infer_response.id for r in replies] == ["s0", "s1", "s2", "s3"]
    assert replies[1].infer_response.model_name == "nope"
    assert replies[3].infer_response.parameters["triton_final_response"].bool_param is True
    assert "triton_final_response" not in replies[0].infer_response.parameters


def test_stream_runs_chunks_of_one_sequence_in_order(stub, fresh):
    # Sequence 9's chunks would finish in reverse order if run concurrently.
    requests = [_stream_request(i, delay_ms=30 * (4 - i), sequence_id=9) for i in range(4)]
    replies = list(stub.ModelStreamInfer(iter(requests), timeout=10))
    assert [r.infer_response.id for r in replies] == ["s0", "s1", "s2", "s3"]
    assert fresh.started == ["s0", "s1", "s2", "s3"]
    assert fresh.max_in_flight == 1


def test_stream_client_cancel_does_not_hang_server(stub, client, fresh):
    done = threading.Event()

    def slow_requests():
        yield _stream_request(0, delay_ms=5000)
        done.wait(5)

    call = stub.ModelStreamInfer(slow_requests(), timeout=10)
    time.sleep(0.2)
    call.cancel()
    done.set()
    time.sleep(0.1)
    assert client.is_server_live()
    deadline = time.monotonic() + 5
    while fresh.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh.in_flight == 0  # the dataplane call was cancelled with the stream


def test_a_stream_chunk_answered_but_never_delivered_ends_its_stream(stub, fresh):
    # Answers go in request order: sequence 5's chunk is done while the slow request before it runs, and the
    # call's deadline ends the call before either answer leaves. The stream's state has moved past a chunk its
    # client never saw; left live, the client's resend of that chunk ran on the wrong state.
    requests = [_stream_request(0, delay_ms=3000), _stream_request(1, sequence_id=5),
                _stream_request(2, delay_ms=3000, sequence_id=6)]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ModelStreamInfer(iter(requests), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while not fresh.ended_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    # only the answered one: sequence 6's chunk was still running, and a chunk cancelled there ends its
    # stream in the dataplane
    # under the call's token, which its chunks carried: the stream ends only if that call moved it last
    (caller,) = {r.caller for r in fresh.requests}
    assert caller != 0
    assert fresh.ended_streams == [("double", "1", 5, "was ended because the answer to one of its chunks could "
                                    "not be delivered (its ModelStreamInfer call ended first), so its state is "
                                    "unknown to the client", caller)]


# -------------------------------------------------------------------- repository


def test_repository_index_load_unload(client, fresh):
    index = client.get_model_repository_index(as_json=True)["models"]
    assert index == [
        {"name": "double", "version": "1", "state": "READY"},
        {"name": "busy", "state": "UNAVAILABLE", "reason": "unloaded"},
    ]
    client.load_model("double")
    client.unload_model("double")
    assert fresh.loaded[-1] == "double" and fresh.unloaded[-1] == "double"

    with pytest.raises(InferenceServerException) as info:
        client.load_model("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"

    with pytest.raises(InferenceServerException) as info:
        client.load_model("double", config='{"max_batch_size": 8}')
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "load parameters are not supported (got config)" in info.value.message()


def test_repository_index_ready_only(stub, fresh):
    reply = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=5)
    assert [m.name for m in reply.models] == ["double"]


# ------------------------------------------------------- malformed and unserved calls


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "RepositoryModelLoad"])
def test_bytes_that_are_not_the_message_are_invalid_argument(channel, client, fresh, method):
    # grpc's own parsing answered UNKNOWN with protobuf's words; the wrapper parses and says what to send
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
    error = _rpc_error(call, b"\xff\xff\xff", timeout=5)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the request is not a valid inference.{method}Request message" in error.details()
    assert "tritonclient.grpc" in error.details()
    assert client.is_server_live()


def test_a_corrupt_message_in_a_stream_ends_it_with_invalid_argument(channel, fresh):
    call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                 response_deserializer=pb.ModelStreamInferResponse.FromString)
    good = _stream_request(0).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter([good, b"\xff\xff\xff"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid inference.ModelInferRequest message" in info.value.details()


@pytest.mark.parametrize("call, words", [
    ("get_system_shared_memory_status", "system shared memory extension (SystemSharedMemoryStatus); send tensors"),
    ("get_cuda_shared_memory_status", "CUDA shared memory extension (CudaSharedMemoryStatus)"),
    ("get_trace_settings", "trace extension (TraceSetting); per-request timings are in the Prometheus metrics"),
    ("get_log_settings", "logging extension (LogSettings); set the log level when the server starts"),
])
def test_tritons_unserved_extensions_say_what_to_use_instead(client, fresh, call, words):
    with pytest.raises(InferenceServerException) as info:
        getattr(client, call)()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "rnnserve does not implement Triton's " + words in info.value.message()


def test_an_unknown_method_lists_the_served_ones(channel, fresh):
    error = _rpc_error(channel.unary_unary("/inference.GRPCInferenceService/Nope"), b"", timeout=5)
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "has no method 'Nope'; rnnserve serves ServerLive, ServerReady" in error.details()
    # another service is grpc's own answer
    other = _rpc_error(channel.unary_unary("/other.Service/Call"), b"", timeout=5)
    assert other.code() == grpc.StatusCode.UNIMPLEMENTED
