"""Front-end coalescing: requests that wait in one front-end process go to the engine process as one.

Under load the engine process's one Python thread is the limit of `rnnserve serve
--frontends N` (H100 host, binary HTTP at concurrency 64: the engine process busy 93 %),
and most of its work is per message: unpickling, queueing, answering and counting
each request. A front-end therefore keeps at most a few messages per model in the engine
process (the model's ``frontend_in_flight``, default :data:`MAX_IN_FLIGHT`); requests that
are validated while those run wait here and leave together, merged into one :class:`~.view.Prepared` (``requests`` = how many),
as soon as one of them is answered. At low load nothing waits: a request leaves in the
event-loop iteration after it was validated. Merging pads with zeros to the longest
valid length and splitting re-pads each answer to its own request's length, exactly as
the engine process's batching does (:func:`service.scheduler.batching.merge` and
:func:`~service.scheduler.batching.split`), and the engine process batches the merged
work with everything else that waits, so no answer changes (packed-sequence semantics).

Only plain requests merge: a request with a ``timeout`` (its own deadline in the
queue) goes alone, as does every request to a model with ``max_batch_size`` 1. Stream
chunks (each with its own stream state) travel together in one message but stay
separate requests in the engine process (:class:`ChunkLane`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ..errors import Unavailable
from ..scheduler import SequenceWork
from ..scheduler.batching import merge, split
from .view import ModelView, Prepared

# Messages per model one front-end keeps in the engine process: the engine runs up to two
# batches at once (one computing, the next one launched behind it), so two keep it fed. On one
# H100 host at concurrency 64: 9,939 req/s with 2, 9,275 with 1, 7,746 with 4
# (bench/results/h100-2026-11-22b/experiment_lanes_concurrency.log).
# A larger model whose batches are GPU-bound and cost about the same with more rows batches more with more
# messages out: 2-layer LSTMs at concurrency 64, binary HTTP, 8 front-ends, one H100 host, limit 2 / 4 / 8:
# H=512 3,198 / 4,011 / 4,102 req/s (batches of 13 / 22 / 29), H=256 5,179 / 6,301 / 7,448
# (bench/results/h100-2026-11-30/). Each model's config.json (``frontend_in_flight``) sets its own.
MAX_IN_FLIGHT = 2
MAX_CHUNKS = 64  # stream chunks per message (ChunkLane)
# At debug level a message whose requests took this long from their submit to its answer is logged with
# where the time went: waiting in the lane, or to the engine process and back (its socket, its loop, its
# batches). The engine process's own request durations start when it decodes a message, so they cannot
# show either (256 paced streams on some H100 hosts: 720-1,800 chunks over 10 ms at the client, 18-640 in
# the engine process's histogram; bench/results/h100-2026-11-27/). The engine process logs its own side of a
# message (read to answer) from the same threshold (service.dataplane.remote).
SLOW_NOTE_S = 0.010

log = logging.getLogger("rnnserve.dataplane.coalesce")


@dataclass(eq=False)
class _Entry:
    prepared: Prepared
    future: asyncio.Future
    queued: float  # perf_counter at submit


class _Coalescing(ABC):
    """What both lanes share: requests wait while ``limit`` messages are out, the ones that
    waited leave together, and a message's outcome goes back to each of its requests.

    A subclass picks a message's requests (``_take``), sends them (``_send_group``, returning the
    message's future and what ``_outcomes`` needs to answer them) and splits the answer
    (``_outcomes``: an (ok, value) per request). A failed or cancelled message fails or cancels
    each of its requests, as it would have each alone.
    """

    def __init__(self, limit: int = MAX_IN_FLIGHT, max_waiting: int | None = None,
                 dropped: Callable[[int], None] | None = None) -> None:
        self._waiting: list[_Entry] = []
        self._dropped = dropped  # told how many requests were cancelled while they waited here (never sent)
        self._in_flight = 0
        self._limit = max(1, int(limit))  # messages out at once
        self._max_waiting = max_waiting  # the model's max_queue_size: requests waiting here at most
        self._scheduled = False

    @property
    def waiting(self) -> int:
        """Requests waiting here for a message slot."""
        return len(self._waiting)

    def submit(self, prepared: Prepared) -> asyncio.Future:
        """Queue one validated request; the future gets its outputs by name (or its error).

        Unavailable at once when the model's ``max_queue_size`` requests already wait here: without the
        bound, requests piled up in the front-end without limit (the engine process's queue holds this
        front-end's few messages, whatever they carry).
        """
        if self._max_waiting is not None and len(self._waiting) >= self._max_waiting:
            raise Unavailable(f"{self._what()} is overloaded: {len(self._waiting)} requests are waiting in this "
                              f"front-end (max_queue_size {self._max_waiting}); retry later")
        loop = asyncio.get_running_loop()
        entry = _Entry(prepared, loop.create_future(), time.perf_counter())
        self._waiting.append(entry)
        if not self._scheduled and self._in_flight < self._limit:
            self._scheduled = True
            loop.call_soon(self._flush)  # requests validated in this loop iteration leave together
        return entry.future

    def _flush(self) -> None:
        self._scheduled = False
        while self._waiting and self._in_flight < self._limit:
            taken = self._take()
            group = [e for e in taken if not e.future.done()]  # a request cancelled while it waited is not sent
            if len(group) < len(taken) and self._dropped is not None:
                self._dropped(len(taken) - len(group))
            if not group:
                continue
            self._in_flight += 1
            fut, context = self._send_group(group)
            sent = time.perf_counter()
            fut.add_done_callback(lambda f, g=group, c=context, s=sent: self._answer(g, c, f, s))
            for i, entry in enumerate(group):
                entry.future.add_done_callback(partial(self._gone, group, fut, i))

    def _gone(self, group: list[_Entry], fut: asyncio.Future, index: int, request: asyncio.Future) -> None:
        """A request of a sent message settled; if it was cancelled (its client went away) before the message
        was answered, tell the engine process (:meth:`_withdraw`), as the one process cancels its work."""
        if request.cancelled() and not fut.done():
            self._withdraw(group, fut, index)

    @abstractmethod
    def _withdraw(self, group: list[_Entry], fut: asyncio.Future, index: int) -> None:
        """Request ``index`` of the message ``fut`` was cancelled before the message was answered."""

    def _note(self, group: list[_Entry], sent: float) -> None:
        """Log (debug) a message whose oldest request took :data:`SLOW_NOTE_S` or more, and where the time went."""
        now = time.perf_counter()
        oldest = min(e.queued for e in group)
        if now - oldest >= SLOW_NOTE_S:
            log.debug("a message of %d requests took %.1f ms in this front-end: %.1f ms waiting in its lane "
                      "(%d messages in flight), %.1f ms to the engine process and back", len(group),
                      1e3 * (now - oldest), 1e3 * (sent - oldest), self._in_flight, 1e3 * (now - sent))

    def _what(self) -> str:
        """What waits here, for messages."""
        return "this model's stream chunks"

    @abstractmethod
    def _take(self) -> list[_Entry]:
        """Remove and return the next message's requests (cancelled ones too: :meth:`_flush` leaves them out)."""

    @abstractmethod
    def _send_group(self, group: list[_Entry]) -> tuple[asyncio.Future, Any]:
        """Send one message; its future, and what :meth:`_outcomes` needs to answer its requests."""

    @abstractmethod
    def _outcomes(self, group: list[_Entry], context: Any, value: Any) -> list[tuple[bool, Any]]:
        """(ok, value) per request of a message from its answer ``value``."""

    def _answer(self, group: list[_Entry], context: Any, fut: asyncio.Future, sent: float) -> None:
        if log.isEnabledFor(logging.DEBUG):
            self._note(group, sent)
        self._in_flight -= 1
        if self._waiting and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        if fut.cancelled():
            for entry in group:
                entry.future.cancel()
            return
        exc = fut.exception()
        outcomes = [(False, exc)] * len(group) if exc is not None else self._outcomes(group, context, fut.result())
        for entry, (ok, value) in zip(group, outcomes):
            if not entry.future.done():
                entry.future.set_result(value) if ok else entry.future.set_exception(value)


class Lane(_Coalescing):
    """The coalescing queue of one model version in one front-end process.

    ``send(prepared)`` hands a Prepared to the engine process and returns the future of
    its outputs. The requests of a message are merged into one Prepared (``requests`` =
    how many) and their answers split back; an error of merged work (StaleModelView
    included) fails each of its requests with it.
    """

    def __init__(self, view: ModelView, send: Callable[[Prepared], asyncio.Future],
                 dropped: Callable[[int], None] | None = None) -> None:
        super().__init__(view.frontend_in_flight, view.max_queue_size, dropped)
        self.view = view
        self._send = send

    def _what(self) -> str:
        return f"model '{self.view.name}'"

    def _take(self) -> list[_Entry]:
        """The oldest waiting requests that fit in one batch of the model, sequences and memory (at least one)."""
        cap, budget, count, longest, n = self.view.max_batch_size, self.view.budget, 0, 0, 0
        for entry in self._waiting:
            work = entry.prepared.work
            if n and (count + work.sequences > cap or not budget.fits(count + work.sequences, max(longest, work.steps))):
                break
            count += work.sequences
            longest = max(longest, work.steps)
            n += 1
        group, self._waiting = self._waiting[:n], self._waiting[n:]
        return group

    def _send_group(self, group: list[_Entry]) -> tuple[asyncio.Future, Any]:
        if len(group) == 1:
            return self._send(group[0].prepared), None
        batch = merge([e.prepared.work for e in group])
        outputs = frozenset().union(*(e.prepared.work.outputs for e in group))
        work = SequenceWork(batch.x, batch.lengths, batch.h0, batch.c0, outputs)
        return self._send(Prepared(work, None, None, len(group))), batch

    def _withdraw(self, group: list[_Entry], fut: asyncio.Future, index: int) -> None:
        # merged work is one request to the engine process: it is withdrawn once none of its requests wants it
        if all(e.future.cancelled() for e in group):
            fut.cancel()

    def _outcomes(self, group: list[_Entry], batch: Any, results: Any) -> list[tuple[bool, Any]]:
        if batch is None:
            return [(True, results)]
        parts = [e.prepared.work for e in group]
        return [(True, part) for part in split(None, batch, results.get("output"), results.get("h_n"),
                                               results.get("c_n"), parts, results.get("output_last"))]


class ChunkLane(_Coalescing):
    """Stream chunks of one model version in one front-end process, sent to the engine process together.

    A stream chunk cannot merge with others into one batch input (each has its own stream
    state), but the engine process's cost per chunk was mostly per message: decoding,
    queueing an answer, encoding it (256 paced streams: chunks with their own state spent
    about 2 ms more in the engine process than the same chunks sent statelessly, which
    coalesce; H100 host). ``send_many(list of Prepared)`` carries every chunk that waits,
    up to :data:`MAX_CHUNKS` a message, and the engine process answers each on its own
    (its outcome, or its own error); chunks of one stream keep their order in a message
    and the engine process runs them in that order. At most :data:`MAX_IN_FLIGHT` messages
    per model are in the engine process, as for :class:`Lane`; a lone chunk leaves at once.
    """

    def __init__(self, send_one: Callable[[Prepared], asyncio.Future],
                 send_many: Callable[[list[Prepared]], asyncio.Future],
                 cancel_item: Callable[[asyncio.Future, int], None], max_waiting: int | None = None,
                 dropped: Callable[[int], None] | None = None) -> None:
        super().__init__(max_waiting=max_waiting, dropped=dropped)
        self._send_one = send_one
        self._send_many = send_many
        self._cancel_item = cancel_item

    def _take(self) -> list[_Entry]:
        group, self._waiting = self._waiting[:MAX_CHUNKS], self._waiting[MAX_CHUNKS:]
        return group

    def _send_group(self, group: list[_Entry]) -> tuple[asyncio.Future, Any]:
        if len(group) == 1:
            return self._send_one(group[0].prepared), None
        return self._send_many([e.prepared for e in group]), None

    def _withdraw(self, group: list[_Entry], fut: asyncio.Future, index: int) -> None:
        # each chunk is its own work in the engine process: the cancelled one alone is withdrawn (which ends
        # its stream there, as in one process), the other streams' chunks of the message run on
        if len(group) == 1:
            fut.cancel()
        else:
            self._cancel_item(fut, index)

    def _outcomes(self, group: list[_Entry], context: Any, value: Any) -> list[tuple[bool, Any]]:
        return [(True, value)] if len(group) == 1 else value
