"""The V2 infer endpoint: one handler, reached first through :class:`InferFastPath`.

Inference is nearly all of a server's traffic, and FastAPI's routing, dependency
solving and exception middleware cost about as much CPU per request as decoding,
batching and encoding it (py-spy on the 2-core CI machine: ~13% of the server's
samples at concurrency 64 vs 9% in the handler itself). So the ASGI app uvicorn runs
is :class:`InferFastPath`, which answers ``POST /v2/models/{m}[/versions/{v}]/infer``
directly and hands everything else to the FastAPI app it wraps. It sits outside
FastAPI's middleware stack, not inside it: each layer there (server errors, telemetry,
body limit) wraps ``send`` and ``receive`` again, which cost a front-end process more
per request than the handler (in-process, stub dataplane: ~46 µs per request inside
the stack, ~37 µs outside). The FastAPI route stays declared (it documents the endpoint in
/docs) and calls the same handler.

Being outermost, it also answers the requests uvicorn cuts off when the server stops: past
``--drain-timeout-s`` uvicorn cancels the requests still running, and left to itself it
answered them with a plain-text "Internal Server Error" 500.
"""
from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from ...dataplane import DataPlane
from ...errors import RNNServeError, Unavailable, cut_off_by_drain
from .answer_coding import answer_coding, compress_answer
from .codec import HEADER, answer_limit, decode_request, encode_response, header_length, json_values
from .decode_gate import DecodeGate
from .head_guard import CLIENT_EOF
from .responses import BodyLimits, error_response, read_decoded_body

T = TypeVar("T")
INFER_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


async def infer_response(dataplane: DataPlane, request: Request, model: str, version: str,
                         limits: BodyLimits, gate: DecodeGate) -> Response:
    """Decode a V2 infer request (JSON or binary extension; a large one through ``gate``), run it, and encode
    the answer."""
    body = await read_decoded_body(request, limits)
    n = header_length(request.headers.getlist(HEADER))
    # binary tensor data is read in place (views of the body): only the JSON header decides whether decoding
    # leaves the event loop (a 60 MB binary body: 0.2 ms in place, 0.5-1 s pickled to the helper and back)
    json_bytes = len(body) if n is None else min(n, len(body))
    req = await gate.decode(decode_request, body, n, model, version, size=json_bytes)
    req.answer_limit = answer_limit(req, limits.max_bytes)
    if req.parameters.get("sequence_id"):
        resp = await _unless_client_leaves(dataplane.infer(req), request)
    else:
        resp = await dataplane.infer(req)
    content, headers = await gate.encode(encode_response, resp, req.parameters,
                                         values=json_values(resp, req.parameters))
    headers["vary"] = "Accept-Encoding"  # encode_response's dict is this answer's own
    coding = answer_coding(request.headers.get("accept-encoding"))
    if coding is not None:  # only then a coroutine more on the hot path
        content = await compress_answer(content, headers, coding)
    return Response(content, headers=headers)


async def _unless_client_leaves(work: Awaitable[T], request: Request) -> T:
    """``work``'s result, or ``work`` cancelled once the client closes its connection.

    For stream chunks: a chunk whose client went away before its answer ends its stream (the client
    cannot know whether the chunk moved the state), as gRPC's cancellation does. ASGI's ``receive``
    gives ``http.disconnect`` once the body is read and the connection closes; the server's protocol
    marks a client's EOF in the scope (:data:`.head_guard.CLIENT_EOF`), which for a chunk counts as
    leaving too: a client that closed cannot be told from one that half-closed, and only the first
    case is safe to guess wrong. Plain requests are not watched: their outcome changes nothing else,
    and watching costs each request a task.
    """
    if request.scope.get(CLIENT_EOF):  # gone already: the chunk is not run, and its stream is as it was
        if asyncio.iscoroutine(work):
            work.close()
        raise Unavailable("the client closed (or half-closed) the connection before its stream chunk ran: the chunk "
                          "was not run and its stream is unchanged; keep the connection open until the answer")
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    left = not task.done() and watch.done() and not watch.cancelled() and (
        watch.result().get("type") == "http.disconnect" or bool(request.scope.get(CLIENT_EOF)))
    if left:
        task.cancel()
        raise Unavailable("the client closed (or half-closed) the connection before its answer: the chunk was "
                          "cancelled, and if it had started its stream was ended (its next chunk gets NOT_FOUND: "
                          "start it again with sequence_start)")
    return await task


class InferFastPath:
    """ASGI app: infer requests go straight to :func:`infer_response`; everything else to ``app`` (FastAPI)."""

    def __init__(self, app: Any, dataplane: DataPlane, limits: BodyLimits, gate: DecodeGate,
                 close: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.dataplane = dataplane
        self.limits = limits
        self.gate = gate
        self._close = close
        self._cut_off: Unavailable | None = None  # set by begin_drain: what a request cancelled from then gets

    def close(self) -> None:
        """Stop what the app started besides serving (its JSON helper process) and wait until it has; call
        once the server stopped, off the event loop.

        A front-end process waits for its child processes when it exits, so a helper left waiting for work
        would hold the front-end (and the server's SIGTERM) until the drain timeout.
        """
        self._close()

    def begin_drain(self, drain_timeout_s: float) -> None:
        """The server is stopping: a request cancelled from now on was cut off at the end of the drain (uvicorn
        cancels what still runs then) and gets 503 with the service's JSON error, so that the client retries it
        on another replica instead of reading uvicorn's plain-text 500 as a server fault."""
        self._cut_off = cut_off_by_drain(drain_timeout_s)
        self.limits.watch.begin_drain()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.fullmatch(scope["path"])
        if match is None:
            if scope["type"] == "http":
                await self._other_route(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        try:
            version = match["version"] or (_query_version(scope["query_string"]) if scope["query_string"] else "")
            response = await infer_response(self.dataplane, Request(scope, receive), match["model"], version,
                                            self.limits, self.gate)
        except RNNServeError as exc:
            response = error_response(exc)
        except asyncio.CancelledError:
            if self._cut_off is None:  # not the drain's: not ours to answer
                raise
            response = self._cut_off_response()
        await response(scope, receive, send)

    async def _other_route(self, scope: dict, receive: Any, send: Any) -> None:
        """The FastAPI app's answer, or the drain's 503 when the request is cut off before its answer began."""
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            # half an answer cannot become another one (uvicorn closes the connection instead)
            if started or self._cut_off is None:
                raise
            await self._cut_off_response()(scope, receive, send)

    def _cut_off_response(self) -> Response:
        """The drain's 503, for a request of this task cancelled once :meth:`begin_drain` was called."""
        # Answered instead of cancelled: uvicorn cancelled this task and does not wait for it, and nothing else
        # in it expects the cancellation (Task.uncancel keeps asyncio's count of pending cancels right).
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return error_response(self._cut_off)


def _query_version(query: bytes) -> str:
    """``?version=N`` of a path without one: the other model routes take it so (FastAPI, and /docs lists it), and
    infer served the latest version instead of the one asked for."""
    from urllib.parse import parse_qs

    return parse_qs(query.decode("latin-1")).get("version", [""])[-1]
