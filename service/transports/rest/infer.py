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
"""
from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from ...dataplane import DataPlane
from ...errors import RNNServeError, Unavailable
from .codec import HEADER, answer_limit, decode_request, encode_response, header_length, json_values
from .decode_gate import DecodeGate
from .responses import error_response, read_decoded_body

T = TypeVar("T")
INFER_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


async def infer_response(dataplane: DataPlane, request: Request, model: str, version: str,
                         max_request_bytes: int, gate: DecodeGate) -> Response:
    """Decode a V2 infer request (JSON or binary extension; a large one through ``gate``), run it, and encode
    the answer."""
    body = await read_decoded_body(request, max_request_bytes)
    n = header_length(request.headers.get(HEADER))
    # binary tensor data is read in place (views of the body): only the JSON header decides whether decoding
    # leaves the event loop (a 60 MB binary body: 0.2 ms in place, 0.5-1 s pickled to the helper and back)
    json_bytes = len(body) if n is None else min(n, len(body))
    req = await gate.decode(decode_request, body, n, model, version, size=json_bytes)
    req.answer_limit = answer_limit(req, max_request_bytes)
    if req.parameters.get("sequence_id"):
        resp = await _unless_client_leaves(dataplane.infer(req), request.receive)
    else:
        resp = await dataplane.infer(req)
    content, headers = await gate.encode(encode_response, resp, req.parameters,
                                         values=json_values(resp, req.parameters))
    return Response(content, headers=headers)


async def _unless_client_leaves(work: Awaitable[T], receive: Callable[[], Awaitable[dict]]) -> T:
    """``work``'s result, or ``work`` cancelled once the client closes its connection.

    For stream chunks: a chunk whose client went away before its answer ends its stream (the client
    cannot know whether the chunk moved the state), as gRPC's cancellation does. ASGI's ``receive``
    gives ``http.disconnect`` once the body is read and the connection closes. Plain requests are
    not watched: their outcome changes nothing else, and watching costs each request a task.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done() and not watch.cancelled() and watch.result().get("type") == "http.disconnect":
        task.cancel()
        raise Unavailable("the client closed the connection before its answer; its stream was ended")
    return await task


class InferFastPath:
    """ASGI app: infer requests go straight to :func:`infer_response`; everything else to ``app`` (FastAPI)."""

    def __init__(self, app: Any, dataplane: DataPlane, max_request_bytes: int, gate: DecodeGate,
                 close: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.dataplane = dataplane
        self.max_request_bytes = max_request_bytes
        self.gate = gate
        self._close = close

    def close(self) -> None:
        """Stop what the app started besides serving (its JSON helper process) and wait until it has; call
        once the server stopped, off the event loop.

        A front-end process waits for its child processes when it exits, so a helper left waiting for work
        would hold the front-end (and the server's SIGTERM) until the drain timeout.
        """
        self._close()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.fullmatch(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await infer_response(self.dataplane, Request(scope, receive), match["model"],
                                            match["version"] or "", self.max_request_bytes, self.gate)
        except RNNServeError as exc:
            response = error_response(exc)
        await response(scope, receive, send)
