"""The gRPC calls in flight, so that the drain can end the ones left at its timeout with the service's answer.

grpc.aio's ``server.stop(grace)`` cancels the calls still running when the grace period ends, and the
client reads grpc's own words ("Cancelling all calls"). The REST transport answers such requests with
the service's 503 (see :class:`~service.transports.rest.infer.InferFastPath`); here the drain cancels
the calls itself at its timeout (:meth:`CallTracker.cut_off`), the wrapper every RPC runs in
(:mod:`.status`) ends each with UNAVAILABLE and the same message, and grpc's own cancel, a moment
later, finds nothing left.
"""
from __future__ import annotations

import asyncio

from ...errors import RNNServeError


class CallTracker:
    """The tasks of the RPCs running now, and what a cancelled one answers once the drain has cut it off."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task] = set()
        self.cut_off_error: RNNServeError | None = None

    def cut_off(self, error: RNNServeError) -> int:
        """Cancel every running call; each answers ``error``. Returns how many there were."""
        self.cut_off_error = error
        calls = [task for task in self.running if not task.done()]
        for task in calls:
            task.cancel()
        return len(calls)

    def answer_for(self, task: asyncio.Task | None) -> RNNServeError | None:
        """The error a call cancelled by :meth:`cut_off` answers (its cancel then taken back), or None when the
        cancellation is not the drain's (the client went away, grpc's own stop): the caller lets it through."""
        if self.cut_off_error is None:
            return None
        if task is not None:
            task.uncancel()  # answered instead: nothing in the call expects the cancellation
        return self.cut_off_error
