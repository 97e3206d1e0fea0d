"""DecodeGate: how many bytes of JSON one REST process decodes at once.

A JSON number becomes a Python float in a list before it becomes 4 bytes of an array:
decoding a 64 MB JSON body of 16 million numbers peaked at 750 MB (2-core CI machine).
Each request is within ``--max-request-bytes``, but a few dozen of them decoded at once
could take the server's memory. So large JSON bodies pass through the gate: they are
decoded while the JSON bytes being decoded stay within its capacity, and wait their turn
in arrival order otherwise (one body larger than the capacity goes alone). Binary tensor
data (the binary extension, what ``tritonclient.http`` sends) is read in place and does
not count; small bodies, which are decoded on the event loop, do not wait at all.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any, AsyncIterator, Callable, TypeVar

from starlette.concurrency import run_in_threadpool

T = TypeVar("T")

# Bodies past this size are decoded off the event loop (by ``offload``: the REST app's JsonProcess), so that
# one large JSON request does not hold it (and every other request) for its whole parse; smaller ones are
# decoded in place.
OFFLOAD_BYTES = 256 * 1024
# Answers with more than this many numbers as JSON text are encoded off the event loop too (``offload``).
OFFLOAD_VALUES = 64 * 1024


class DecodeGate:
    """Admits JSON decoding by bytes, first come first served, up to ``capacity`` bytes at once.

    ``offload(fn, *args)`` runs a large body's decoding (default: a worker thread, which bounds memory but
    not the GIL: see :mod:`.json_process`).
    """

    def __init__(self, capacity: int, offload: Callable[..., Any] = run_in_threadpool) -> None:
        self.capacity = capacity
        self._offload = offload
        self._used = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        """Wait until ``size`` bytes of JSON may be decoded, and hold them while the block runs."""
        size = min(size, self.capacity)
        if self._waiting or self._used + size > self.capacity:
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append((size, turn))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # admitted as it was cancelled: give the bytes back
                    self._release(size)
                else:
                    self._waiting.remove((size, turn))
                    self._admit()  # it may have held up smaller bodies behind it
                raise
        else:
            self._used += size
        try:
            yield
        finally:
            self._release(size)

    async def decode(self, fn: Callable[..., T], *args: Any, size: int, json_bytes: int | None = None) -> T:
        """``fn(*args)``: on the event loop for a small body (``size`` bytes), else through ``offload`` once the
        gate admits its ``json_bytes`` (default: all of it)."""
        if size <= OFFLOAD_BYTES:
            return fn(*args)
        async with self.hold(size if json_bytes is None else json_bytes):
            return await self._offload(fn, *args)

    async def encode(self, fn: Callable[..., T], *args: Any, values: int) -> T:
        """``fn(*args)`` encoding an answer of ``values`` numbers as JSON text: in place for a small one, else
        through ``offload`` (outside the gate: binary outputs are a copy and count as none)."""
        if values <= OFFLOAD_VALUES:
            return fn(*args)
        return await self._offload(fn, *args)

    @property
    def in_use(self) -> int:
        """Bytes of JSON being decoded now."""
        return self._used

    def _release(self, size: int) -> None:
        self._used -= size
        self._admit()

    def _admit(self) -> None:
        while self._waiting and self._used + self._waiting[0][0] <= self.capacity:
            size, turn = self._waiting.popleft()
            self._used += size
            turn.set_result(None)
