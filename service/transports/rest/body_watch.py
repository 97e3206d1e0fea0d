"""BodyWatch: a request whose body stops arriving gets 408 instead of holding its connection forever.

uvicorn waits for a request body as long as the client keeps the connection open, so a client that sends
its headers, or part of a body, and then nothing (a stalled upload, or a slowloris) holds a connection, its
buffered bytes and a task for good. Each request reading its body is noted here with the time its last part
came; one timer for all of them, every :data:`SWEEP_S`, cancels the readers that have waited longer than the
pause allowed, and :func:`.responses.read_body` turns that cancel into :class:`RequestTimeout`. One shared
timer, not one per request: a per-request ``asyncio.timeout`` costs ~5 µs on every request, this ~0.5 µs.

When the server starts to drain, a body may pause at most :data:`DRAIN_PAUSE_S` (whatever --body-timeout-s
says, 0 included): a stalled upload would otherwise hold the stop to the end of --drain-timeout-s, for a
request that has not started. Its reader gets :class:`BodyCutAtDrain` (503: send it again, to another replica);
a body that keeps arriving is read and answered as any request in flight.
"""
from __future__ import annotations

import asyncio

from ...errors import RNNServeError, Unavailable

SWEEP_S = 1.0
DRAIN_PAUSE_S = 1.0


class RequestTimeout(RNNServeError):
    """The client paused its request body for longer than --body-timeout-s."""

    status = "REQUEST_TIMEOUT"


class BodyCutAtDrain(Unavailable):
    """The server began to stop while the request body was paused; nothing of the request ran."""


class BodyWatch:
    """Times the pauses of the request bodies being read on one event loop (``pause_s`` 0: never)."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.draining = False
        # readers are noted with no limit too (pause_s 0), so that a drain can cut the stalled ones
        self._reading: dict[asyncio.Task, float] = {}
        self._expired: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None

    def begin(self, task: asyncio.Task) -> None:
        """``task`` starts reading a body."""
        loop = asyncio.get_running_loop()
        self._reading[task] = loop.time()
        if self._timer is None and self.pause_s > 0:
            self._timer = loop.call_later(SWEEP_S, self._sweep)

    def begin_drain(self) -> None:
        """The server is stopping: from now on a body may pause at most :data:`DRAIN_PAUSE_S`."""
        self.draining = True
        self.pause_s = min(self.pause_s, DRAIN_PAUSE_S) if self.pause_s > 0 else DRAIN_PAUSE_S
        if self._timer is None and self._reading:
            self._timer = asyncio.get_running_loop().call_later(min(SWEEP_S, self.pause_s), self._sweep)

    def progress(self, task: asyncio.Task) -> None:
        """A part of ``task``'s body came: its pause starts again."""
        if task in self._reading:
            self._reading[task] = asyncio.get_running_loop().time()

    def end(self, task: asyncio.Task) -> bool:
        """``task`` stopped reading; returns whether this watch cancelled it (then the caller answers 408)."""
        self._reading.pop(task, None)
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for task, last in list(self._reading.items()):
            if now - last > self.pause_s and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        # no timer while nothing reads: an idle server does not wake up for this
        self._timer = loop.call_later(SWEEP_S, self._sweep) if self._reading else None
