"""How the REST transport reads request bodies and reports errors (one place for both)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ...errors import STATUS_TABLE, RNNServeError


class RequestTooLarge(RNNServeError):
    """The request body is larger than --max-request-bytes."""

    status = "RESOURCE_EXHAUSTED"


def error_response(exc: RNNServeError) -> JSONResponse:
    """The one way an error leaves the REST transport."""
    code = STATUS_TABLE.get(exc.status, STATUS_TABLE["INTERNAL"])[0]
    return JSONResponse({"error": exc.message}, status_code=code)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with RequestTooLarge past ``limit`` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"request body of {declared} bytes is larger than the limit of {limit} bytes "
                              f"(--max-request-bytes); send fewer or shorter sequences")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is larger than the limit of {limit} bytes (--max-request-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
