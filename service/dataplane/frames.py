"""Frames between a front-end process and an engine process: 8-byte little-endian length + pickle (protocol 5).

The message layer of :mod:`.remote` (what each frame means is described there); both ends are
processes of this server, on a socket in a private temporary folder, so pickle is safe.
"""
from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any, Callable

_LENGTH = struct.Struct("<Q")


def frame_parts(obj: Any) -> tuple[bytes, bytes]:
    """One frame of the wire format as (length, body); writers join frames once, not per frame."""
    data = pickle.dumps(obj, protocol=5)
    return _LENGTH.pack(len(data)), data


class FrameConnection(asyncio.Protocol):
    """One end of a connection: frames in through ``on_frame(obj)``, out through :meth:`send`.

    A protocol rather than stream reader/writer coroutines: a burst of frames is parsed in one
    ``data_received`` call, and the frames sent during one event-loop iteration (a finished
    batch answers many requests at once) leave in one write, one system call.
    """

    def __init__(self, on_frame: Callable[[Any], None], on_lost: Callable[[], None] | None = None) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buf = bytearray()
        self._out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        # Frames are read through memoryviews: a request's arrays are most of its bytes, and a
        # bytearray slice per frame (plus appending every read to the buffer) copied them twice
        # more on the engine process's one busy thread. Only an incomplete tail is kept.
        buf = self._buf
        if buf:
            buf += data
            data = buf
        pos, end = 0, len(data)
        with memoryview(data) as view:
            while end - pos >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(view, pos)
                stop = pos + _LENGTH.size + size
                if stop > end:
                    break
                with view[pos + _LENGTH.size:stop] as frame:
                    obj = pickle.loads(frame)  # in-band buffers are copied out: nothing keeps the frame
                pos = stop
                self._on_frame(obj)
            tail = view[pos:].tobytes() if pos < end and data is not buf else None
        if data is buf:
            del buf[:pos]
        elif tail:
            buf += tail

    def send(self, obj: Any) -> None:
        """Queue ``obj``; everything queued in this loop iteration goes out in one write."""
        if self.closed:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out += frame_parts(obj)  # joined once in _flush: no copy per frame here

    def _flush(self) -> None:
        if self._out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._on_lost is not None:
            self._on_lost()
