"""The drain's cut-off of gRPC calls (service.transports.grpc.calls) through the wrapper every RPC runs in."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from service.errors import cut_off_by_drain
from service.transports.grpc.calls import CallTracker
from service.transports.grpc.status import _wrap

pytestmark = pytest.mark.asyncio


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    async def abort(self, code, message):
        self.aborted = (code, message)
        raise aio.AbortError()


async def _slow(request, context):
    await asyncio.sleep(30)


async def _running_call() -> tuple[CallTracker, _Context, asyncio.Task]:
    """A unary call through the wrapper, running (in ``calls``) until cancelled."""
    calls = CallTracker()
    context = _Context()
    task = asyncio.create_task(_wrap(_slow, lambda raw: raw, False, calls)(b"", context))
    await asyncio.sleep(0.01)
    assert calls.running == {task}
    return calls, context, task


async def test_a_call_cut_off_by_the_drain_answers_unavailable_with_the_service_s_message():
    calls, context, task = await _running_call()
    assert calls.cut_off(cut_off_by_drain(0.5)) == 1
    with pytest.raises(aio.AbortError):
        await task
    assert context.aborted[0] == grpc.StatusCode.UNAVAILABLE
    assert context.aborted[1].startswith("the server is shutting down and this request did not finish within its "
                                         "drain timeout (0.5s, --drain-timeout-s)")
    assert calls.running == set()


async def test_a_call_cancelled_otherwise_stays_cancelled():
    # the client went away, or grpc stops the server: not the drain's answer to give
    calls, context, task = await _running_call()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert context.aborted is None and calls.running == set()


async def test_a_streaming_call_is_cut_off_too():
    async def stream(request, context):
        yield 1
        await asyncio.sleep(30)
        yield 2

    calls = CallTracker()
    context = _Context()
    seen = []

    async def consume():
        async for item in _wrap(stream, lambda raw: raw, False, calls)(b"", context):
            seen.append(item)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    calls.cut_off(cut_off_by_drain(2))
    with pytest.raises(aio.AbortError):
        await task
    assert seen == [1] and context.aborted[0] == grpc.StatusCode.UNAVAILABLE
