"""HTTP connections spread evenly over the front-end processes: the one with the fewest accepts.

With SO_REUSEPORT the kernel hashes each new connection to one front-end. Clients keep their
connections open (tritonclient, load balancers and the benchmark all pool them), so the hash's
unevenness lasts as long as the connections: on an H100 host, 64 keep-alive connections landed
3 to 12 per front-end, the busiest front-ends ran at their CPU limit while one idled at half of
it, and the requests of the crowded ones waited in their event loops (bench/results/h100-s31/).

Here the front-ends share one listening socket and a table of how many connections each holds
(shared memory, each front-end writes only its own slot). A front-end accepts a waiting
connection only while it holds no more than the fewest; one that holds more looks again after
:data:`DEFER_S`, and accepts after :data:`MAX_DEFERS` looks anyway, so a connection never waits
on a front-end that is stuck. Only HTTP: grpc listens on its own sockets (SO_REUSEPORT).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import multiprocessing
import socket
from typing import Any, Callable

log = logging.getLogger("rnnserve.transports.rest.balanced_accept")

DEFER_S = 0.002  # how long a front-end with more connections than the fewest waits before it looks again
MAX_DEFERS = 3  # looks after which it accepts anyway (the front-end with the fewest may be busy or stuck)
BACKLOG = 2048
_RETRY_S = 0.1  # after an accept error such as EMFILE (too many open files)


class ConnectionTable:
    """How many HTTP connections each front-end process holds, in memory they all share."""

    def __init__(self, frontends: int, ctx: Any = None) -> None:
        self.counts = (ctx or multiprocessing).RawArray("q", frontends)

    def fewest(self) -> int:
        """The fewest connections any front-end holds (read without a lock: a slot is written by its owner only)."""
        return min(self.counts)


def shared_listener(sock: socket.socket) -> socket.socket:
    """``sock`` (bound, see :func:`service.ports.bind_listener`) listening, for every front-end to accept from."""
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


class BalancedAcceptor:
    """Accepts connections from the shared listening socket for this front-end (slot ``index`` of ``table``).

    ``protocol_factory``: the HTTP server's protocol for one connection (uvicorn's, see
    :meth:`service.app.Transports.start`).
    """

    def __init__(self, sock: socket.socket, table: ConnectionTable, index: int,
                 protocol_factory: Callable[[], asyncio.Protocol]) -> None:
        self._sock = sock
        self._table = table
        self._index = index
        self._factory = protocol_factory
        self._loop = asyncio.get_running_loop()
        self._defers = 0
        self._later: asyncio.TimerHandle | None = None
        self._reading = False
        self._closed = False
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        """Begin accepting."""
        self._watch()

    def close(self) -> None:
        """Stop accepting (a drain); connections already accepted stay with the HTTP server."""
        if self._closed:
            return
        self._closed = True
        self._unwatch()
        if self._later is not None:
            self._later.cancel()
        self._sock.close()

    def _watch(self) -> None:
        if not self._closed and not self._reading:
            self._loop.add_reader(self._sock.fileno(), self._readable)
            self._reading = True

    def _unwatch(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _look_later(self, delay: float) -> None:
        self._unwatch()
        self._later = self._loop.call_later(delay, self._look_again)

    def _look_again(self) -> None:
        self._later = None
        self._watch()

    def _readable(self) -> None:
        counts = self._table.counts
        if counts[self._index] > self._table.fewest() and self._defers < MAX_DEFERS:
            # every front-end wakes for a waiting connection: leave it to one that holds fewer
            self._defers += 1
            self._look_later(DEFER_S)
            return
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            # another front-end took it, or its client gave up before the accept: the next one starts the count again
            self._defers = 0
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("cannot accept an HTTP connection (%s); trying again in %.1fs", exc, _RETRY_S)
                self._look_later(_RETRY_S)
                return
            raise
        self._defers = 0
        counts[self._index] += 1  # before the protocol exists, so that a burst does not all land here
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self._loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        lost_once = False

        def release() -> None:
            nonlocal lost_once
            if not lost_once:
                lost_once = True
                self._table.counts[self._index] -= 1

        def factory() -> asyncio.Protocol:
            protocol = self._factory()
            inner = protocol.connection_lost

            def connection_lost(exc: Exception | None) -> None:
                release()
                inner(exc)

            protocol.connection_lost = connection_lost  # type: ignore[method-assign]
            return protocol

        try:
            await self._loop.connect_accepted_socket(factory, conn)
        except Exception as exc:  # noqa: BLE001 - the client went away during the hand-over: nothing to serve
            log.debug("an accepted HTTP connection could not be served: %s", exc)
            release()
            conn.close()
