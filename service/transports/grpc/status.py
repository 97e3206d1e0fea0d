"""The one mapping from rnnserve errors to gRPC status, applied to every RPC.

:class:`ErrorMappingInterceptor` wraps every method handler of the server, so an
RPC cannot forget to map an error: a :class:`~service.errors.RNNServeError` ends
the call with the gRPC code of its status in :data:`~service.errors.STATUS_TABLE`
and its message; anything else ends it with INTERNAL and a message (and is logged
with its traceback), never UNKNOWN and never a hang. ModelStreamInfer, which
reports per-message errors inside the stream, uses :func:`grpc_status` for the
same text.
"""
from __future__ import annotations

import inspect
import logging

import grpc
from grpc import aio

from ...errors import STATUS_TABLE, RNNServeError

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


def _wrap(behavior):
    """``behavior`` (coroutine or async-generator handler) with errors mapped."""
    if inspect.isasyncgenfunction(behavior):
        async def stream_behavior(request_or_iterator, context):
            try:
                async for response in behavior(request_or_iterator, context):
                    yield response
            except aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc)
        return stream_behavior

    async def unary_behavior(request_or_iterator, context):
        try:
            result = behavior(request_or_iterator, context)
            return await result if inspect.isawaitable(result) else result
        except aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)
    return unary_behavior


_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class ErrorMappingInterceptor(aio.ServerInterceptor):
    """Applies :func:`grpc_status` to every RPC the server serves."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        for kind, make in _KINDS.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(
                    _wrap(behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler
