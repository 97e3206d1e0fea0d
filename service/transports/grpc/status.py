"""The one mapping from rnnserve errors to gRPC status, applied to every RPC.

:func:`register` adds a servicer to a server with every RPC method wrapped once, so an RPC
cannot forget to map an error: a :class:`~service.errors.RNNServeError` ends the call with
the gRPC code of its status in :data:`~service.errors.STATUS_TABLE` and its message;
anything else ends it with INTERNAL and a message (and is logged with its traceback),
never UNKNOWN and never a hang. ModelStreamInfer, which reports per-message errors inside
the stream, uses :func:`grpc_status` for the same text. (A grpc.aio server interceptor
would do the same but runs per call, ~20-40 µs of an RPC's CPU.)

Requests are parsed inside the wrapper, not by grpc: grpc ends a call whose bytes do not
parse with UNKNOWN and protobuf's words; here it is INVALID_ARGUMENT with what to change.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc import aio

from ...errors import STATUS_TABLE, InvalidInput, RNNServeError
from .calls import CallTracker

log = logging.getLogger(__name__)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and message for an exception raised while serving an RPC."""
    if isinstance(exc, RNNServeError):
        code = STATUS_TABLE.get(exc.status, STATUS_TABLE["INTERNAL"])[1]
        return grpc.StatusCode[code], exc.message
    log.error("unexpected error while serving a gRPC call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: aio.ServicerContext, exc: Exception):
    code, message = grpc_status(exc)
    await context.abort(code, message)


def _parser(message_class) -> Callable[[bytes], Any]:
    """``message_class.FromString`` that says what to change when the bytes are not such a message."""
    name = message_class.DESCRIPTOR.full_name

    def parse(raw: bytes):
        try:
            return message_class.FromString(raw)
        except DecodeError as exc:
            raise InvalidInput(
                f"the request is not a valid {name} message ({exc}); send it with a client generated from "
                f"rnnserve's or Triton's grpc_service.proto (e.g. tritonclient.grpc)") from None
    return parse


async def _parsed(raw_messages: AsyncIterator[bytes], parse) -> AsyncIterator[Any]:
    async for raw in raw_messages:
        yield parse(raw)


def _wrap(behavior, parse, client_streaming: bool, calls: CallTracker | None):
    """``behavior`` (coroutine or async-generator handler) fed parsed requests, with errors mapped; while it runs
    its task is in ``calls`` (see :mod:`.calls`: the drain's cut-off answers it)."""
    def request_of(raw):
        return _parsed(raw, parse) if client_streaming else parse(raw)

    if inspect.isasyncgenfunction(behavior):
        async def stream_behavior(raw, context):
            task = _enter(calls)
            try:
                async for response in behavior(request_of(raw), context):
                    yield response
            except aio.AbortError:
                raise
            except asyncio.CancelledError:
                if not await _answer_cut_off(calls, task, context):
                    raise
            except Exception as exc:
                await _abort(context, exc)
            finally:
                _leave(calls, task)
        return stream_behavior

    async def unary_behavior(raw, context):
        task = _enter(calls)
        try:
            result = behavior(request_of(raw), context)
            return await result if inspect.isawaitable(result) else result
        except aio.AbortError:
            raise
        except asyncio.CancelledError:
            if not await _answer_cut_off(calls, task, context):
                raise
        except Exception as exc:
            await _abort(context, exc)
        finally:
            _leave(calls, task)
    return unary_behavior


def _enter(calls: CallTracker | None) -> asyncio.Task | None:
    task = asyncio.current_task()
    if calls is not None and task is not None:
        calls.running.add(task)
    return task


async def _answer_cut_off(calls: CallTracker | None, task: asyncio.Task | None, context: aio.ServicerContext) -> bool:
    """End a cancelled call with the drain's answer when the drain cut it off (AbortError); False when the
    cancellation is someone else's (the client went away, grpc's stop): the caller re-raises it then."""
    error = calls.answer_for(task) if calls is not None else None
    if error is None:
        return False
    await _abort(context, error)
    return True


def _leave(calls: CallTracker | None, task: asyncio.Task | None) -> None:
    if calls is not None:
        calls.running.discard(task)


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def register(server: aio.Server, servicer: Any, service_descriptor, calls: CallTracker | None = None) -> None:
    """Serve each RPC of ``service_descriptor`` that ``servicer`` has a method for, errors mapped (and each call
    kept in ``calls`` while it runs).

    In place of the generated ``add_*_to_server``, which has grpc parse the requests.
    """
    handlers = {}
    for method in service_descriptor.methods:
        behavior = getattr(servicer, method.name, None)
        if behavior is None:
            continue
        kind = (method.client_streaming, method.server_streaming)
        response_class = GetMessageClass(method.output_type)
        handlers[method.name] = _HANDLER_KINDS[kind](
            _wrap(behavior, _parser(GetMessageClass(method.input_type)), method.client_streaming, calls),
            request_deserializer=None,  # bytes: parsed by the wrapper
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))
    server.add_registered_method_handlers(service_descriptor.full_name, handlers)
