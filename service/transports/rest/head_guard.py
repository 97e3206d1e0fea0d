"""HeadGuard: uvicorn's HTTP protocol with limits on request heads and on open connections, and JSON errors.

uvicorn (with httptools) bounds neither the size of a request head nor the time it may take:
one client sending a header that never ends grew a server by ~1 GB a minute and slowed every
request on it (parsing a growing head), and thousands of connections that sent half a head
and waited held their file descriptors until none was left, for gRPC too. So here:

- a head (request line and headers) may be at most :data:`MAX_HEAD_BYTES`; a longer one gets
  431 and the connection closes;
- a head must arrive whole within ``head_timeout_s`` (the server's ``--body-timeout-s``) of
  its first byte, or of the connection's start; then 408 (nothing sent yet: just closed);
- at most ``max_connections`` HTTP connections are open at once (``--max-http-connections``);
  one more gets 503 and is closed at once, so its descriptor is free again;
- a request the parser cannot read gets a JSON 400, as every other error, not uvicorn's text,
  and uvicorn's warning for it is logged at most once every 10 s;
- a request asking to switch protocols (``Connection: Upgrade``; ``curl --http2`` asks for h2c on
  every plain-HTTP request) is served as HTTP/1.1, as RFC 9110 section 7.8 lets a server do. The
  parser stops at such a request's head and takes what follows for the new protocol's bytes, so
  uvicorn ran the request with an empty body: its Content-Length bytes are now its body, and the
  parser goes on after them.

Counting is per chunk read, after the parser has seen it: a chunk is counted when the head
was already incomplete before it and still is after it, so a body that arrives with its head is
never counted. The limit is therefore one of reads: a head that arrives whole within one or two
reads (up to ~128 KiB on a fast connection) is served; one that keeps coming is refused after
64 KiB more at most, which is what bounds memory and parsing work.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ...log_limit import ThrottleFilter

MAX_HEAD_BYTES = 64 * 1024
# Set in a request's ASGI scope when its client has sent all it will (EOF) before the answer: a half-close, or a
# client that closed and left (TCP cannot tell them apart). Plain requests are still answered; a stream chunk's
# handler reads it as its client leaving (service.transports.rest.infer).
CLIENT_EOF = "rnnserve.client_eof"


def _answer(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


_MALFORMED = _answer(400, "Bad Request",
                    "the request is not valid HTTP/1.1: its request line (too long a URL, past 64 KiB), its headers "
                    "or its body's framing could not be parsed (a Content-Length other than the body's size runs the "
                    "body into the next request); send a well-formed request")

_TOO_LARGE = _answer(431, "Request Header Fields Too Large",
                     f"the request line and headers take more than {MAX_HEAD_BYTES} bytes; send fewer or shorter "
                     f"headers (tensors go in the body)")
_UPGRADE_CHUNKED = _answer(400, "Bad Request",
                           "a request asking to switch protocols (Connection: Upgrade) is served as HTTP/1.1 only with "
                           "a Content-Length body; send it with Content-Length, or without the Upgrade header (curl: "
                           "leave out --http2)")


def http_connection_cap(setting: int) -> int:
    """``--max-http-connections``, or for 0 three quarters of this process's open-file limit (the rest is for gRPC,
    the engine sockets and model files); 0 when the limit is unlimited."""
    if setting:
        return setting
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else max(16, soft * 3 // 4)


# uvicorn's warnings that any client can cause with every request it sends
_CLIENT_CAUSED = ThrottleFilter(("Invalid HTTP request received.", "Unsupported upgrade request.",
                                 "No supported WebSocket library detected"))


def head_guard(head_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn should use: HttpToolsProtocol with these limits (0: no limit).

    It also throttles uvicorn's warnings for unreadable requests to one line every 10 s."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _CLIENT_CAUSED not in uvicorn_log.filters:
        uvicorn_log.addFilter(_CLIENT_CAUSED)
    timeout_answer = _answer(408, "Request Timeout", f"the request's headers did not arrive whole within "
                                                     f"{head_timeout_s:g} s (--body-timeout-s); send them at once")
    busy_answer = _answer(503, "Service Unavailable", f"this server holds {max_connections} HTTP connections "
                                                      f"(--max-http-connections); retry, or reuse a connection")

    class HeadGuard(HttpToolsProtocol):
        _head_bytes: int | None = 0   # bytes of the head being read; None once it is whole
        _head_timer: asyncio.TimerHandle | None = None
        _owed: int = 0  # body bytes still to come for a request whose Upgrade was ignored (the parser stopped)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections and len(self.connections) > max_connections:
                transport.write(busy_answer)
                transport.close()
                return
            self._start_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            while data:  # a loop, not recursion: a read may hold a thousand pipelined upgrade requests
                data = self._take_body(data) if self._owed else self._parse(data)

        def _parse(self, data: bytes) -> bytes:
            """Feed ``data`` to the parser (uvicorn's data_received, with the limits); the bytes after the head
            of a request asking to switch protocols, which the parser left unread."""
            reading_head = self._head_bytes is not None
            self._unset_keepalive_if_required()
            rest = b""
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
                return b""
            except httptools.HttpParserUpgrade as stop:
                if self._should_upgrade():  # a websocket, were a library for it installed
                    self.handle_websocket_upgrade()
                    return b""
                data, rest = data[:stop.args[0]], self._serve_without_upgrade(data[stop.args[0]:])
            if reading_head and self._head_bytes is not None and self.transport is not None:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self._stop_head_timer()
                    self.transport.write(_TOO_LARGE)
                    self.transport.close()
                    return b""
            return rest

        def eof_received(self) -> bool | None:
            # The client has sent all it will (shutdown(SHUT_WR), as `nc -N` and some scripts do) and still reads:
            # the requests it sent whole are answered, then the connection closes. uvicorn returned None here, so
            # asyncio closed the socket at once and a request that had been run lost its answer.
            cycle = self.cycle
            if cycle is None or cycle.response_complete or cycle.more_body:
                return None  # nothing to answer, or a body that will never end: close now
            last = self.pipeline[0][0] if self.pipeline else cycle  # pipelined requests are answered in order
            last.keep_alive = False
            for waiting in [cycle, *(c for c, _ in self.pipeline)]:
                waiting.scope[CLIENT_EOF] = True
                waiting.message_event.set()  # wakes a handler watching receive() for its client leaving
            return True

        def _serve_without_upgrade(self, rest: bytes) -> bytes:
            """The parser stopped after the head of a request asking to switch protocols (and ended its body
            there): serve it as HTTP/1.1 with its Content-Length bytes from ``rest`` on as its body. Returns
            ``rest``, for its body and then the parser (resumed by httptools), or b"" where it closed."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete or self.transport.is_closing():
                return b""
            if any(k == b"transfer-encoding" for k, _ in self.headers):
                self.transport.write(_UPGRADE_CHUNKED)  # its length unknown, the parser's framing gone
                self.transport.close()
                return b""
            length = next((v for k, v in self.headers if k == b"content-length"), b"0")
            self._owed = int(length) if length.isdigit() else 0
            cycle.more_body = self._owed > 0
            return rest

        def _take_body(self, data: bytes) -> bytes:
            """Give the request whose upgrade was ignored the body bytes it is owed from ``data``; the rest (the
            next request). As uvicorn's own body reading: reading pauses while the handler has not taken what came,
            and a request answered before its body ended (a 413) closes the connection rather than keep it."""
            cycle = self.cycle
            if cycle.response_complete:
                self._owed = 0
                self.transport.close()
                return b""
            part = data[:self._owed]
            self._owed -= len(part)
            cycle.body += part
            if len(cycle.body) > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            if not self._owed:
                cycle.more_body = False
            cycle.message_event.set()
            return data[len(part):]

        def on_response_complete(self) -> None:
            if self._owed and not self.transport.is_closing():  # answered before the body it is owed ended
                self._owed = 0
                self.transport.close()
                return
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's own answer is plain text; every other error of the server is {"error": ...}
            self.transport.write(_MALFORMED)
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_bytes is None:  # the next request on a kept-alive connection
                self._start_head()

        def on_headers_complete(self) -> None:
            self._head_bytes = None
            self._stop_head_timer()
            super().on_headers_complete()

        def _start_head(self) -> None:
            self._head_bytes = 0
            if head_timeout_s > 0:
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_expired)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport is None or self.transport.is_closing():
                return
            if self._head_bytes:  # part of a head came: say why it is closed
                self.transport.write(timeout_answer)
            self.transport.close()

    return HeadGuard
