"""HTTP answers in one write: uvicorn's protocol over a transport that joins a response's head and body.

uvicorn writes a response's status line and headers (``http.response.start``) and its body
(``http.response.body``) with two ``transport.write`` calls, and uvloop sends each at once: two
system calls and two TCP segments per answer, and a client that wakes for the head and then again
for the body. Under binary-HTTP load the two writes were a seventh of a front-end process's samples
(py-spy, 2-core VM, concurrency 64). :class:`CorkedTransport` holds a write until the next one
and sends both together; a write that nothing follows (a head whose body is streamed later, the
``100 Continue`` line) goes out once the event loop comes round (``call_soon``), so nothing waits
for more than an iteration.
"""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

# Above this a held head and its body go out by writelines (no copy of a large body into a joined buffer).
JOIN_BYTES = 64 << 10


class CorkedTransport:
    """A transport whose writes leave in pairs: each write is held until the next (or the loop's next turn).

    Everything but writing and closing is the wrapped transport's own.
    """

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        """Send ``data`` together with the write held before it, or hold it until the next write."""
        held = self._held
        if held is None:
            if data:
                held = self._held = data if type(data) is bytes else bytes(data)  # the caller may reuse its buffer
                self._loop.call_soon(self._release, held)
            return
        self._held = None
        if len(held) + len(data) <= JOIN_BYTES:
            self._transport.write(held + data)
        else:
            self._transport.writelines((held, data))

    def writelines(self, chunks: Any) -> None:
        """Send ``chunks`` after the held write."""
        self.write(b"".join(chunks))

    def _release(self, data: bytes) -> None:
        if self._held is data:  # nothing followed it in this iteration
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        """Send the held write, then close."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)
        self._transport.close()

    def abort(self) -> None:
        """Close at once; a held write is dropped, as the transport drops its buffer."""
        self._held = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        """The transport's buffer plus the held write."""
        return self._transport.get_write_buffer_size() + (len(self._held) if self._held is not None else 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CorkedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools, or h11 without it) writing through a :class:`CorkedTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, asyncio.get_running_loop()))
