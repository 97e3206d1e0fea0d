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
from typing import Mapping

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


async def encode_answer(content: bytes, headers: Mapping[str, str], accept_encoding: str | None
                        ) -> tuple[bytes, dict[str, str]]:
    """``content`` compressed as the request accepts, with ``Content-Encoding`` (and ``Vary``) added to ``headers``."""
    out = dict(headers)
    out["vary"] = "Accept-Encoding"
    coding = answer_coding(accept_encoding)
    if coding is None:
        return content, out
    if len(content) > _INLINE_BYTES:
        content = await asyncio.to_thread(_compress, content, coding)
    else:
        content = _compress(content, coding)
    out["content-encoding"] = coding
    return content, out
