"""Compressed infer answers: the ``Accept-Encoding`` of a request picks gzip or deflate, as in Triton.

``tritonclient.http`` asks with ``response_compression_algorithm`` ("gzip" or "deflate") and inflates
what comes back by its ``Content-Encoding``; ``Inference-Header-Content-Length`` still counts the
uncompressed JSON header, as Triton sends it. Compressing costs the server CPU, so only a request
that asks gets it.
"""
from __future__ import annotations

import asyncio
import gzip
import zlib

# Answers past this size are compressed on a thread (a MB of answer: 30 ms of zlib at its default level for binary
# float32, 55-85 ms for JSON, on the 2-core VM).
_INLINE_BYTES = 64 * 1024
_CODINGS = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}


def answer_coding(accept_encoding: str | None) -> str | None:
    """"gzip" or "deflate" when ``accept_encoding`` accepts one (the higher q-value; gzip on a tie), else None."""
    if not accept_encoding:
        return None
    best: tuple[float, int, str] | None = None
    for item in accept_encoding.split(","):
        name, _, params = item.partition(";")
        coding = _CODINGS.get(name.strip().lower())
        if coding is None:
            continue  # identity, *, br...: answered uncompressed
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        rank = (q, coding == "gzip", coding)
        if q > 0 and (best is None or rank > best):
            best = rank
    return None if best is None else best[2]


def _compress(content: bytes, coding: str) -> bytes:
    return gzip.compress(content) if coding == "gzip" else zlib.compress(content)


async def compress_answer(content: bytes, headers: dict[str, str], coding: str) -> bytes:
    """``content`` compressed with ``coding`` (from :func:`answer_coding`); ``Content-Encoding`` set in ``headers``."""
    headers["content-encoding"] = coding
    if len(content) > _INLINE_BYTES:
        return await asyncio.to_thread(_compress, content, coding)
    return _compress(content, coding)
