"""The one mapping from rnnserve errors to gRPC status, applied to every RPC.

:func:`map_errors` wraps every RPC method of a servicer once, as it is registered,
so an RPC cannot forget to map an error: a :class:`~service.errors.RNNServeError` ends
the call with the gRPC code of its status in :data:`~service.errors.STATUS_TABLE`
and its message; anything else ends it with INTERNAL and a message (and is logged
with its traceback), never UNKNOWN and never a hang. ModelStreamInfer, which
reports per-message errors inside the stream, uses :func:`grpc_status` for the
same text. (A grpc.aio server interceptor would do the same but runs per call,
~20-40 µs of an RPC's CPU.)
"""
from __future__ import annotations

import inspect
import logging
from typing import TypeVar

import grpc
from grpc import aio

from ...errors import STATUS_TABLE, RNNServeError

log = logging.getLogger(__name__)
Servicer = TypeVar("Servicer")


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


def map_errors(servicer: Servicer, service_descriptor) -> Servicer:
    """``servicer`` with each RPC method of ``service_descriptor`` wrapped once: its errors mapped.

    Call it before the servicer is added to the server: the generated ``add_*_to_server``
    reads the (now wrapped) methods from the instance.
    """
    for method in service_descriptor.methods:
        behavior = getattr(servicer, method.name, None)
        if behavior is not None:
            setattr(servicer, method.name, _wrap(behavior))
    return servicer
