"""GRPCInferenceService: the Open Inference Protocol over gRPC, as a thin transport.

Each RPC converts wire messages to protocol types (:mod:`.codec`), calls the one
:class:`~service.dataplane.DataPlane`, and converts back. Errors are raised, not
handled here: :func:`.status.register` maps them for every RPC.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, AsyncIterator

import grpc
from google.protobuf import json_format

from ...dataplane.repository_parameters import check_load_parameters, check_unload_parameters
from ...dataplane.types import AnswerLimit
from ...errors import InvalidInput, NotFound, TooLarge, Unavailable
from .codec import decode_parameters, decode_request, encode_response
from .generated import inference_pb2 as pb
from .generated import inference_pb2_grpc as pb_grpc
from .status import grpc_status

log = logging.getLogger("rnnserve.grpc")

# How many ModelStreamInfer requests of one stream may be in flight at once.
STREAM_WINDOW = 64
# What a ModelStreamInferResponse takes besides its raw output tensors and the texts it repeats from the request:
# four outputs' names, datatypes and shapes, field tags and lengths, parameters, the stream's wrapper (under 300 bytes).
ANSWER_FRAME_BYTES = 512
# A ModelStreamInferResponse around its ModelInferResponse: the field's tag and length, an empty error_message.
_STREAM_WRAPPER_BYTES = 16
# Room in a ModelInferResponse beside its raw output tensors (names, shapes, parameters): far above what they take.
_SIZE_HEADROOM = 64 * 1024


def _wants_status_errors(context) -> bool:
    """Whether the call asked, as Triton's clients do with the header ``triton_grpc_error: true``, for a failed
    request to end the stream with its gRPC status instead of an error_message answer."""
    try:
        metadata = context.invocation_metadata() or ()
    except Exception:  # noqa: BLE001 - a context without metadata (tests' fakes): the default behaviour
        return False
    return any(key == "triton_grpc_error" and str(value).strip().lower() == "true" for key, value in metadata)


def _sequence_key(msg: pb.ModelInferRequest) -> tuple[str, Any] | None:
    """The (model, sequence_id) a request continues, or None when it is stateless."""
    param = msg.parameters.get("sequence_id")
    if param is None:
        return None
    which = param.WhichOneof("parameter_choice")
    value = getattr(param, which) if which else None
    if value in (None, 0, ""):
        return None
    return (msg.model_name, value)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Serves GRPCInferenceService from a DataPlane."""

    def __init__(self, dataplane, stream_window: int = STREAM_WINDOW, max_message_bytes: int | None = None) -> None:
        self._dataplane = dataplane
        self._endings: set[asyncio.Future] = set()
        self._readers: set[asyncio.Task] = set()  # each open ModelStreamInfer call's reader of its requests
        self._draining = False
        self._stream_window = stream_window
        self._max_message_bytes = max_message_bytes
        # answers are FP32 raw contents, 4 bytes a number: refused before they run when those alone are over the limit
        self._answer_limit = None if max_message_bytes is None else AnswerLimit(
            max_message_bytes, 4, "ask only for the outputs you need (output_last instead of output), raise the limit",
            what="the server's gRPC message limit", overhead=ANSWER_FRAME_BYTES)

    def begin_drain(self) -> None:
        """The server is stopping: every open ModelStreamInfer call stops reading requests, answers the ones it
        has, and ends with UNAVAILABLE. An idle stream held the drain to its timeout, and then was told its
        requests had not finished in time when none was running."""
        self._draining = True
        for reader in list(self._readers):
            reader.cancel()

    async def _answer(self, request: pb.ModelInferRequest, wrapper: int = 0, caller: int = 0) -> pb.ModelInferResponse:
        """The ModelInferResponse to ``request``, refused with a message that says what to change when it is
        over the message limit (grpc would fail the send with only the two sizes). ``wrapper``: bytes the
        message it travels in adds (a stream's); ``caller``: the ModelStreamInfer call's token (0: unary)."""
        decoded = decode_request(request)
        decoded.caller = caller
        decoded.answer_limit = self._answer_limit  # refused before it runs: tensors, echoed texts, framing
        limit = None if self._max_message_bytes is None else self._max_message_bytes - wrapper
        response = encode_response(await self._dataplane.infer(decoded))
        # A backstop for the estimate above, after the run (a stream's state has moved by then): the exact size,
        # but ByteSize encodes the whole message, so only answers whose tensors come near the limit pay for it.
        if (limit is not None and sum(map(len, response.raw_output_contents)) > limit - _SIZE_HEADROOM
                and (size := response.ByteSize()) > limit):
            raise TooLarge(
                f"the answer of model '{request.model_name}' is {size:,} bytes, over the server's gRPC message limit "
                f"of {limit:,} bytes (--max-request-bytes); ask only for the outputs you need (output_last instead of "
                f"output), send fewer or shorter sequences per request, or raise the limit")
        return response

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=await self._dataplane.live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=await self._dataplane.ready())

    async def ModelReady(self, request, context):
        # Triton answers OK with ready=false for a model or version it does not know: a client polling for a
        # model that is about to be added waits instead of failing (REST keeps its 404, whose body says why).
        try:
            ready = await self._dataplane.model_ready(request.name, request.version)
        except NotFound:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        meta = await self._dataplane.server_metadata()
        return pb.ServerMetadataResponse(
            name=meta["name"], version=str(meta["version"]), extensions=list(meta.get("extensions", []))
        )

    async def ModelMetadata(self, request, context):
        meta = await self._dataplane.model_metadata(request.name, request.version)

        def tensors(items):
            return [
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t["name"], datatype=t["datatype"], shape=[int(d) for d in t["shape"]]
                )
                for t in items
            ]

        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=[str(v) for v in meta.get("versions", [])],
            platform=meta.get("platform", ""),
            inputs=tensors(meta.get("inputs", [])),
            outputs=tensors(meta.get("outputs", [])),
        )

    async def ModelConfig(self, request, context):
        config = await self._dataplane.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def ModelStatistics(self, request, context):
        stats = await self._dataplane.model_statistics(request.name, request.version)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    async def ModelInfer(self, request, context):
        return await self._answer(request)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answers each request in request order; a failed one answers with error_message, or, when the call
        was opened with the header ``triton_grpc_error: true`` (Triton's), ends the call with its gRPC status.

        Requests run concurrently (up to ``stream_window`` in flight), so independent
        requests of one stream can batch together; requests of the same sequence
        (same model and ``sequence_id``) run one after another, in stream order.
        """
        status_errors = _wants_status_errors(context)
        in_order: asyncio.Queue[tuple[asyncio.Task, pb.ModelInferRequest] | None] = asyncio.Queue()
        # this call's chunks run under it, so that an answer it could not deliver ends only the stream it moved
        caller = secrets.randbits(63) | 1
        window = asyncio.Semaphore(self._stream_window)
        last_of_sequence: dict[tuple[str, Any], asyncio.Task] = {}

        def forget(key, task):
            if last_of_sequence.get(key) is task:
                del last_of_sequence[key]

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    key = _sequence_key(request)
                    task = asyncio.create_task(self._stream_one(request, last_of_sequence.get(key), caller))
                    if key is not None:
                        last_of_sequence[key] = task
                        task.add_done_callback(lambda t, k=key: forget(k, t))
                    in_order.put_nowait((task, request))
            finally:
                in_order.put_nowait(None)

        reader = asyncio.create_task(read())
        self._readers.add(reader)
        if self._draining:  # opened while the server stops: no request is read
            reader.cancel()
        answered = 0
        try:
            while (item := await in_order.get()) is not None:
                response, status = await item[0]
                window.release()
                if status is not None and status_errors:
                    # Triton closes the stream after such an error: requests not yet read are not run
                    reader.cancel()
                    await self._settle(in_order, caller)
                    await context.abort(*status)
                answered += 1
                yield response
            try:
                await reader  # a failure to read the stream ends the call with its status
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not self._draining or (current is not None and current.cancelling()):
                    raise
                # a request read while the window was full is dropped unrun: the count tells the client where to
                # go on (answers come in request order)
                raise Unavailable(f"the server is stopping: this ModelStreamInfer call ends here, after answering "
                                  f"the first {answered} request(s) it sent, in order; later ones were not run: send "
                                  f"them to another replica") from None
        finally:
            self._readers.discard(reader)
            reader.cancel()
            while not in_order.empty():
                item = in_order.get_nowait()
                if item is None:
                    continue
                task, request = item
                if not task.done():
                    task.cancel()  # a chunk cancelled once queued ends its stream in the dataplane
                elif not task.cancelled() and not task.result()[0].error_message and _sequence_key(request):
                    # answered, and its stream moved on, but the answer waited behind an earlier request and the
                    # call ended first: the client never saw it, so the stream must not go on from there
                    self._end_undelivered(request, task.result()[0].infer_response.model_version, caller)

    async def _settle(self, in_order: asyncio.Queue, caller: int) -> None:
        """Before a call ends on a failed request (``triton_grpc_error``): let the requests already running finish,
        and end every stream one of them moved, before the client hears of the failure.

        Cancelling them instead could land after the engine had moved a stream (the answer lost, the stream not
        ended: the client, told its chunk failed the call, resent it and it was applied twice, one trial in four);
        and the endings are awaited so that a chunk resent at once on another call finds its stream ended.
        """
        endings = []
        while not in_order.empty():
            item = in_order.get_nowait()
            if item is None:
                continue
            task, request = item
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                # the call itself ends (the client cancelled, its deadline passed): the chunk goes back to the
                # cleanup in ModelStreamInfer, which cancels it or ends the stream it moved (taken out here, it ran
                # on unseen and its stream stayed moved: a resent chunk was applied twice)
                in_order.put_nowait(item)
                raise
            if not task.cancelled() and not task.result()[0].error_message and _sequence_key(request):
                endings.append(self._end_undelivered(request, task.result()[0].infer_response.model_version, caller))
        if endings:
            await asyncio.wait(endings)

    def _end_undelivered(self, request: pb.ModelInferRequest, version: str, caller: int) -> asyncio.Future:
        why = ("was ended because the answer to one of its chunks could not be delivered (its ModelStreamInfer call "
               "ended first), so its state is unknown to the client")
        ending = asyncio.ensure_future(self._dataplane.end_stream(
            request.model_name, version, decode_parameters(request.parameters), why, caller))
        self._endings.add(ending)  # held until done: the call's generator is gone by then
        ending.add_done_callback(self._ended)
        return ending

    def _ended(self, ending: asyncio.Future) -> None:
        self._endings.discard(ending)
        if not ending.cancelled() and ending.exception() is not None:
            log.warning("ending a stream whose answer was not delivered failed: %s", ending.exception())

    async def _stream_one(self, request: pb.ModelInferRequest, after: asyncio.Task | None, caller: int
                          ) -> tuple[pb.ModelStreamInferResponse, tuple[grpc.StatusCode, str] | None]:
        """The request's answer, and for a failed one its gRPC status (else None)."""
        if after is not None:
            await asyncio.wait([after])
        final = request.parameters.get("triton_enable_empty_final_response")
        try:
            kind = None if final is None else final.WhichOneof("parameter_choice")
            if final is not None and kind != "bool_param":
                # checked before the request runs: a stream chunk must not move its state and then be refused
                got = f"{kind.removesuffix('_param')} {getattr(final, kind)!r}" if kind else "no value"
                raise InvalidInput(f"parameter 'triton_enable_empty_final_response' must be true or false "
                                   f"(bool_param), got {got}")
            infer_response = await self._answer(request, _STREAM_WRAPPER_BYTES, caller)
        except Exception as exc:
            status = grpc_status(exc)
            message = status[1]
            echoed = sum(len(text.encode()) for text in (request.id, request.model_name, request.model_version))
            if (self._max_message_bytes is not None
                    and echoed + len(message.encode()) + ANSWER_FRAME_BYTES > self._max_message_bytes):
                # past the message limit grpc would end the whole call, and every later request's answer with it
                short = pb.ModelStreamInferResponse(error_message=f"{message} (this request's id and model name "
                                                                  f"are too long to repeat within the message limit)")
                return short, status
            # The request's identity goes back with the error, so clients can match them.
            return pb.ModelStreamInferResponse(
                error_message=message,
                infer_response=pb.ModelInferResponse(
                    model_name=request.model_name, model_version=request.model_version, id=request.id
                ),
            ), status
        if final is not None and final.bool_param:
            # Non-decoupled models answer once: that answer is the final one (Triton's flag).
            infer_response.parameters["triton_final_response"].bool_param = True
        return pb.ModelStreamInferResponse(infer_response=infer_response), None

    async def RepositoryIndex(self, request, context):
        models = await self._dataplane.repository_index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=m["name"],
                    version=str(m.get("version", "")),
                    state=m.get("state", ""),
                    reason=m.get("reason", ""),
                )
                for m in models
            ]
        )

    async def RepositoryModelLoad(self, request, context):
        check_load_parameters(request.model_name, decode_parameters(request.parameters))
        await self._dataplane.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        check_unload_parameters(decode_parameters(request.parameters))
        await self._dataplane.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()
