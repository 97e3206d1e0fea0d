"""An HTTP answer leaves in one write (service.transports.rest.corked), with uvicorn's own protocol."""
from __future__ import annotations

import asyncio

import pytest
import uvicorn
from starlette.responses import Response

from service.transports.rest.corked import JOIN_BYTES, CorkedHTTPProtocol, CorkedTransport

pytestmark = pytest.mark.asyncio


class RecordingTransport(asyncio.Transport):
    """A transport that keeps what is written to it, one entry per write call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False
        self.protocol = None

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks) -> None:  # type: ignore[override]
        self.writes.append(b"".join(bytes(c) for c in chunks))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol


async def _app(scope, receive, send) -> None:
    body = b"x" * int(scope["path"].rsplit("/", 1)[1])
    await Response(body, media_type="application/octet-stream")(scope, receive, send)


async def _serve(requests: bytes) -> RecordingTransport:
    config = uvicorn.Config(_app, http=CorkedHTTPProtocol, lifespan="off", log_level="warning")
    config.load()
    server_state = uvicorn.server.ServerState()
    protocol = config.http_protocol_class(config=config, server_state=server_state, app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(requests)
    for _ in range(20):  # the request tasks, then the loop turns that release held writes
        await asyncio.sleep(0)
    protocol.connection_lost(None)
    return transport


async def test_the_protocol_is_uvicorn_s_own():
    config = uvicorn.Config(_app, http=CorkedHTTPProtocol, lifespan="off")
    config.load()
    assert config.http_protocol_class is CorkedHTTPProtocol
    assert issubclass(CorkedHTTPProtocol, uvicorn.protocols.http.auto.AutoHTTPProtocol)


@pytest.mark.parametrize("size", [0, 10, 5000, JOIN_BYTES + 100])
async def test_an_answer_is_one_write(size):
    transport = await _serve(f"GET /{size} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    assert len(transport.writes) == 1, [w[:40] for w in transport.writes]
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert f"content-length: {size}".encode() in head
    assert body == b"x" * size


async def test_pipelined_requests_get_whole_answers_in_order():
    transport = await _serve(b"GET /3 HTTP/1.1\r\nhost: x\r\n\r\nGET /5 HTTP/1.1\r\nhost: x\r\n\r\n")
    data = b"".join(transport.writes)
    assert data.count(b"HTTP/1.1 200 OK") == 2
    first, second = data.split(b"HTTP/1.1 200 OK")[1:]
    assert first.endswith(b"\r\n\r\nxxx") and second.endswith(b"\r\n\r\nxxxxx")
    assert len(transport.writes) == 2


async def test_a_lone_write_goes_out_on_the_next_loop_turn():
    inner = RecordingTransport()
    corked = CorkedTransport(inner, asyncio.get_running_loop())
    corked.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert inner.writes == []
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    await asyncio.sleep(0)
    assert len(inner.writes) == 1  # released once


async def test_writes_pair_up_and_a_reused_buffer_is_copied():
    inner = RecordingTransport()
    corked = CorkedTransport(inner, asyncio.get_running_loop())
    buf = bytearray(b"head")
    corked.write(buf)
    buf[:] = b"XXXX"
    corked.write(b"body")
    corked.write(b"next")
    assert inner.writes == [b"headbody"]
    await asyncio.sleep(0)
    assert inner.writes == [b"headbody", b"next"]


async def test_close_sends_the_held_write_first_and_abort_drops_it():
    loop = asyncio.get_running_loop()
    inner = RecordingTransport()
    corked = CorkedTransport(inner, loop)
    corked.write(b"last words")
    assert corked.get_write_buffer_size() == len(b"last words")
    corked.close()
    assert inner.writes == [b"last words"] and inner.closed
    await asyncio.sleep(0)
    assert inner.writes == [b"last words"]

    inner = RecordingTransport()
    corked = CorkedTransport(inner, loop)
    corked.write(b"dropped")
    corked.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.aborted


async def test_a_held_write_is_not_sent_on_a_closed_transport():
    inner = RecordingTransport()
    corked = CorkedTransport(inner, asyncio.get_running_loop())
    corked.write(b"late")
    inner.closed = True  # the peer went away meanwhile
    await asyncio.sleep(0)
    assert inner.writes == []
