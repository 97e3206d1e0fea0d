"""How the REST transport reads request bodies and reports errors (one place for both)."""
from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from ...errors import STATUS_TABLE, InvalidInput, RNNServeError, TooLarge
from .body_watch import BodyCutAtDrain, BodyWatch, RequestTimeout

# zlib window bits of each request Content-Encoding tritonclient sends (gzip.compress, zlib.compress); names are
# case-insensitive, and x-gzip is gzip (RFC 9110 8.4.1)
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# Compressed bodies past this size are inflated on a thread (a few KB of gzip can hold MBs).
_INLINE_COMPRESSED_BYTES = 16 * 1024

# Bytes a number takes in a JSON answer: Python prints each float32 as the double nearest it, up to ~20
# characters with its comma (-0.0012345678918063641,), and holds it meanwhile as a float in a list (32 bytes).
JSON_VALUE_BYTES = 20


class RequestTooLarge(TooLarge):
    """The request body is larger than --max-request-bytes."""


def error_response(exc: RNNServeError) -> JSONResponse:
    """The one way an error leaves the REST transport."""
    code = STATUS_TABLE.get(exc.status, STATUS_TABLE["INTERNAL"])[0]
    # the rest of a stalled body would be read as the next request: the connection ends with this answer
    headers = {"connection": "close"} if isinstance(exc, (RequestTimeout, BodyCutAtDrain)) else None
    message = exc.message
    try:
        message.encode("utf-8")
    except UnicodeEncodeError:
        # a message quoting a client's string with a lone surrogate in it cannot be sent as UTF-8 JSON;
        # unescaped it made this answer itself fail (a bare 500, the connection closed)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": message}, status_code=code, headers=headers)


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may be: at most ``max_bytes`` (--max-request-bytes), with no pause longer than
    ``watch.pause_s`` between its parts (--body-timeout-s)."""

    max_bytes: int
    watch: BodyWatch


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The whole body, refused with RequestTooLarge past ``limits.max_bytes`` (declared or streamed) and with
    RequestTimeout when it pauses too long."""
    limit = limits.max_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"request body of {declared} bytes is larger than the limit of {limit} bytes "
                              f"(--max-request-bytes); send fewer or shorter sequences")
    chunks, size = [], 0
    task = asyncio.current_task()
    limits.watch.begin(task)
    try:
        async for chunk in request.stream():
            limits.watch.progress(task)
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"request body is larger than the limit of {limit} bytes (--max-request-bytes)")
            chunks.append(chunk)
    except ClientDisconnect:
        # nobody reads the answer; raised, it was logged as an error with a traceback per such client
        raise InvalidInput("the client closed the connection before it sent the whole body") from None
    except asyncio.CancelledError:
        if limits.watch.end(task) and task.uncancel() == 0:  # the watch's cancel, and nobody else's
            if limits.watch.draining:
                raise BodyCutAtDrain(f"the server is shutting down and the request body paused for more than "
                                     f"{limits.watch.pause_s:g} s; nothing of it ran: send it again") from None
            raise RequestTimeout(f"the request body stopped arriving for more than {limits.watch.pause_s:g} s "
                                 f"(--body-timeout-s); send the whole body without pausing") from None
        raise
    finally:
        limits.watch.end(task)
    return b"".join(chunks)


async def read_decoded_body(request: Request, limits: BodyLimits) -> bytes:
    """The body (:func:`read_body`) with its Content-Encoding undone (:func:`decompress`): what every route
    that takes a body reads."""
    transfer = request.headers.get("transfer-encoding")
    if transfer and transfer.strip().lower() != "chunked":
        # the parser undoes chunked only: a 'gzip, chunked' body reached the JSON decoder still compressed
        raise InvalidInput(f"Transfer-Encoding '{transfer}' is not supported (only chunked); send a compressed "
                           f"body with Content-Encoding: gzip or deflate instead")
    body = await read_body(request, limits)
    encoding = request.headers.get("content-encoding")
    if encoding and encoding != "identity" and len(body) > _INLINE_COMPRESSED_BYTES:
        # zlib lets go of the GIL while it inflates: on a thread, the event loop keeps serving (82 MB of JSON
        # from 37 MB of gzip: 0.30 s inline, pauses of at most 0.04 s on a thread; development machine)
        return await asyncio.to_thread(decompress, body, encoding, limits.max_bytes)
    return decompress(body, encoding, limits.max_bytes)


# gzip members one body may hold (tritonclient writes one; concatenating tools a few)
MAX_MEMBERS = 1024
_PIECE = 64 * 1024


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo a request ``Content-Encoding`` of gzip or deflate (tritonclient's request compression).

    The output is held to ``limit`` bytes as it is produced: a few MB of zeros compress a
    thousandfold, and unbounded they would fill the server's memory (RequestTooLarge instead).
    """
    if not encoding or encoding == "identity":
        return body
    encoding = encoding.strip().lower()
    if encoding == "identity":
        return body
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise InvalidInput(f"Content-Encoding '{encoding}' is not supported; use gzip, deflate or none")
    parts: list[bytes] = []
    size, members, pos = 0, 0, 0
    view = memoryview(body)
    carry = b""  # what followed the member that just ended: the start of the next one
    try:
        while pos < len(view) or carry:  # gzip may hold several members one after another
            members += 1
            if members > MAX_MEMBERS:
                raise InvalidInput(f"request body holds more than {MAX_MEMBERS} {encoding} members; compress it "
                                   f"as one stream")
            stream = zlib.decompressobj(wbits)
            while not stream.eof:
                # bounded pieces: the data after a member's end is copied out (unused_data), and with the whole
                # body fed at once a body of many tiny members took time growing with its size squared
                if carry:
                    pending, carry = carry, b""
                elif pos < len(view):
                    pending, pos = view[pos:pos + _PIECE], pos + _PIECE
                else:
                    raise InvalidInput(f"request body is not valid {encoding} data: it ends before its stream "
                                       f"does (truncated?)")
                while pending and not stream.eof:
                    part = stream.decompress(pending, limit + 1 - size)
                    size += len(part)
                    if size > limit:
                        raise RequestTooLarge(f"request body is larger than the limit of {limit} bytes "
                                              f"(--max-request-bytes) once {encoding}-decompressed; send fewer or "
                                              f"shorter sequences")
                    parts.append(part)
                    pending = stream.unconsumed_tail
            carry = stream.unused_data
            if wbits == zlib.MAX_WBITS and (carry or pos < len(view)):  # deflate: one stream, nothing after it
                raise InvalidInput(f"request body has {len(carry) + max(0, len(view) - pos)} bytes after its "
                                   f"deflate stream; send the compressed data alone")
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {encoding} data: {exc}") from None
    return b"".join(parts)
