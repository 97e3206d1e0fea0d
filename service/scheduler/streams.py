"""StreamStore: server-side state of stateful streams (Triton's sequence_id) for one model version.

A stream is one sequence sent in chunks. Its first chunk carries ``sequence_start``
(state starts at zeros, or at the h_0/c_0 that chunk carries), each later chunk
continues from the state the previous one left, and the chunk with ``sequence_end``
frees it. Chunks of one stream run one at a time, in arrival order (a FIFO lock per
stream); chunks of different streams batch together like any other requests, since
a chunk is just a sequence with an initial state.

A stream's state (h and c of every layer and direction of every block) lives in a slot
of the engine's state pool (:mod:`service.engines.state_pool`): on the GPU engine it
never leaves GPU memory between chunks. A stream holds its slot from its start until it
ends and no chunk of it is running.

Errors (each names the stream and says what to do):

* a chunk without ``sequence_start`` for a stream that is not live: NOT_FOUND, saying
  whether it was never started, ended with sequence_end, expired, or ended by an
  unload/reload (the store remembers the last ``_REMEMBERED`` ended ids and why);
* ``sequence_start`` for a stream that is live is no error, as in Triton: the live stream ends early
  (its chunks still waiting get NOT_FOUND saying it was restarted) and a new one starts;
* a new stream over ``max_streams``: UNAVAILABLE (HTTP 503);
* a chunk cancelled before its answer (the client went away) ends its stream: the
  state may or may not include that chunk, so a later chunk gets NOT_FOUND saying so
  rather than continuing from an unknown state.

A chunk whose stream has no other chunk queued or running takes the stream's turn at once and
goes straight to the scheduler (:class:`Turn`); only a chunk that must wait for an earlier one of
its stream waits in a task. A task per chunk cost each chunk two to three extra event-loop
iterations in the engine process, which are long under load (bench/engine_process.py --streams
256, closed loop: 10.0-10.4 ms in the engine process instead of 12.7-13.3 ms; on the GPU the A/B
was within the hosts' spread).

A stream with no chunk for ``idle_timeout_s`` is dropped with its state by a sweeper
task (and on every open), and counted as an expiration. With front-end processes a chunk
can wait in a front-end, unseen by the engine process, while its stream's time runs out
there: while the front-ends report chunks of its model waiting, a stream expires only
after twice its timeout, and an idle stream outlives its timeout by ``expiry_grace_s``
(twice the reports' period).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..engines.state_pool import StatePool
from ..errors import NotFound, Unavailable
from ..log_limit import ThrottledLog
from ..metrics import ServerMetrics

log = logging.getLogger("rnnserve.streams")
_REMEMBERED = 4096  # ended stream ids kept to explain a late chunk


class Turn:
    """A stream's chunks one at a time, in arrival order: :meth:`take_now` without waiting when free,
    else :meth:`take`; whoever holds the turn passes it on with :meth:`give`."""

    __slots__ = ("busy", "_waiters")

    def __init__(self) -> None:
        self.busy = False
        self._waiters: deque[asyncio.Future] = deque()

    def take_now(self) -> bool:
        """Take the turn if nobody holds it or waits for it; False otherwise."""
        if self.busy or self._waiters:
            return False
        self.busy = True
        return True

    async def take(self) -> None:
        """Wait for the turn behind everyone who waits already."""
        if self.take_now():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed the turn, then cancelled: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def give(self) -> None:
        """Pass the turn to the next waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy = False


@dataclass(eq=False)
class StreamState:
    """One live stream: its state pool slot and the turn ordering its chunks."""

    key: str
    slot: int = -1  # -1: released (the stream ended)
    last_used: float = field(default_factory=time.monotonic)
    turn: Turn = field(default_factory=Turn)
    ended: str = ""  # why the stream ended, "" while live
    running: bool = False  # a chunk is in the scheduler: its batch may still write the slot
    held: bool = False  # ended while a chunk ran: counted in its store's held slots until settled
    last_caller: int = 0  # the transport's token of the call whose chunk ran last (see end)


class StreamStore:
    """Live streams of one model version."""

    def __init__(self, model: str, version: str, max_streams: int, idle_timeout_s: float,
                 pool: StatePool, metrics: ServerMetrics | None = None, expiry_grace_s: float = 0.0) -> None:
        self.model = model
        self.pool = pool
        self.version = version
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self.waiting_chunks = 0  # chunks waiting for their stream's turn (service.dataplane bounds them)
        self.frontends_waiting = 0  # stream chunks of this version waiting in front-end processes, as last reported
        self.expiry_grace_s = expiry_grace_s
        self._metrics = metrics
        self._owns_gauges = True  # see release_gauges
        self._labels = {"model": model, "version": version}
        self._streams: dict[str, StreamState] = {}
        self._held: dict[str, int] = {}  # ended streams whose chunk still runs (their slot held), by key
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._last_sweep = 0.0
        self._sweeper: asyncio.Task | None = None
        self._restarts_log = ThrottledLog(log)  # a client restarting streams on every chunk must not flood the log

    def __len__(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        """Start the task that drops idle streams even when no chunk arrives; the live-streams gauge reads 0."""
        self._gauge()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name=f"streams-{self.model}-{self.version}")

    async def _sweep_loop(self) -> None:
        period = min(1.0, max(0.01, self.idle_timeout_s / 4))  # a tiny timeout spun a core with no stream
        while True:
            await asyncio.sleep(period)
            self._sweep(time.monotonic(), force=True)

    def open(self, key: str, start: bool) -> StreamState:
        """A fresh stream ``key`` when ``start``, else the live one; raises the errors listed above."""
        now = time.monotonic()
        self._sweep(now)
        state = self._streams.get(key)
        if start:
            self._check_restart(key, state)
            if state is not None:
                # As Triton: the live stream ends early and this chunk starts a new one (a client that restarts
                # its sequence under the same id, after a crash or a reconnect, is not locked out until expiry);
                # its chunks still waiting are refused, saying so.
                self._restarts_log.warning(
                    "stream %s of model '%s' got a second sequence_start while live: the earlier stream ends early "
                    "and a new one starts (rnnserve_stream_ends_total{reason=\"restart\"} counts them all)",
                    key if key.isprintable() else ascii(key), self.model)
                self.close(state, "was restarted: a later chunk started the sequence again (sequence_start)",
                           "restart")
            if len(self._streams) >= self.max_streams:
                raise Unavailable(f"model '{self.model}' has {len(self._streams)} live streams (max_streams "
                                  f"{self.max_streams}, which holds in each engine process); end finished streams "
                                  f"with sequence_end or retry later")
            try:
                slot = self.pool.acquire()
            except Unavailable:
                raise Unavailable(self._slots_taken()) from None
            state = self._streams[key] = StreamState(key, slot, last_used=now)
            self._ended.pop(key, None)
            if self._metrics is not None:
                self._metrics.stream_starts.labels(**self._labels).inc()
            self._gauge()
            return state
        if state is None:
            why = self._ended.get(key)
            if why:
                raise NotFound(f"stream {key} of model '{self.model}' is not live: it {why}; start a new stream "
                               f"with sequence_start")
            raise NotFound(f"stream {key} of model '{self.model}' is not live (never started, or ended long ago); "
                           f"send its first chunk with sequence_start")
        state.last_used = now
        return state

    def _check_restart(self, key: str, live: StreamState | None) -> None:
        """Unavailable, with the live stream left as it is, where a sequence_start for ``key`` would hold one more
        state slot for a chunk that is already moot: each restart while the earlier instance's chunk is still
        queued keeps that instance's slot until the chunk has run, so a client restarting one id in a loop took
        every slot of the model (and lost its live stream to the refusal)."""
        if self._held.get(key):
            raise Unavailable(f"stream {key} of model '{self.model}' was restarted while a chunk of an earlier, "
                              f"already restarted instance of it is still queued or running: wait for the answers "
                              f"to the chunks you sent before restarting it again (sequence_start)")
        if live is not None and live.running and not self.pool.free:
            raise Unavailable(self._slots_taken())

    def _slots_taken(self) -> str:
        held = sum(self._held.values())
        why = (f" ({held} of them held by restarted or ended streams until their queued chunks have run)"
               if held else "")
        return (f"all {self.pool.max_slots} stream state slots of model '{self.model}' are in use{why}; end "
                f"finished streams with sequence_end, retry later, or raise max_streams")

    def check_live(self, state: StreamState) -> None:
        """NotFound when ``state`` ended while a chunk waited for it (an expiry cannot hit a waited-on stream)."""
        if state.ended:
            raise NotFound(f"stream {state.key} of model '{self.model}' is not live: it {state.ended}")

    def close(self, state: StreamState, why: str = "ended with sequence_end", outcome: str = "end") -> None:
        """Forget ``state`` and remember why (sequence_end, a failed first chunk, expiry, unload)."""
        if state.ended:
            return
        state.ended = why
        self.settle(state)
        if state.slot >= 0:  # its chunk runs on: the slot stays held until it settles
            state.held = True
            self._held[state.key] = self._held.get(state.key, 0) + 1
        if self._streams.get(state.key) is state:
            del self._streams[state.key]
            self._remember(state.key, why)
            if self._metrics is not None:
                if outcome == "expired":
                    self._metrics.stream_expirations.labels(**self._labels).inc()
                else:
                    self._metrics.stream_ends.labels(**self._labels, reason=outcome).inc()
        self._gauge()

    def end(self, key: str, why: str, caller: int) -> None:
        """End live stream ``key`` with ``why`` if its last chunk came from ``caller``: its state moved past a chunk
        whose answer that call never delivered, so its next chunk must be refused, not run on a state the client
        does not know. A stream the client restarted since (a new instance under the same id), or moved on with
        from another call, is the client's to keep."""
        state = self._streams.get(key)
        if state is not None and state.last_caller == caller:
            self.close(state, why, "error")

    def settle(self, state: StreamState) -> None:
        """Give an ended stream's slot back once no chunk of it runs (called again when its chunk ends)."""
        if state.ended and not state.running and state.slot >= 0:
            self.pool.release(state.slot)
            state.slot = -1
            if state.held:
                state.held = False
                left = self._held.pop(state.key) - 1
                if left:
                    self._held[state.key] = left

    def clear(self, why: str) -> None:
        """End every stream (unload or reload); their next chunk gets NotFound with ``why``."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for state in list(self._streams.values()):
            self.close(state, why, "unload")
        self._gauge()

    def adopt_endings(self, other: "StreamStore", live_why: str = "") -> None:
        """Remember why ``other``'s streams ended (a reload's new store explains the old store's ids); with
        ``live_why``, its live streams too, as ending for that reason (the old store's, about to end them)."""
        for key, why in other._ended.items():
            self._remember(key, why)
        if live_why:
            for key in other._streams:
                self._remember(key, live_why)

    def _remember(self, key: str, why: str) -> None:
        self._ended[key] = why
        self._ended.move_to_end(key)
        while len(self._ended) > _REMEMBERED:
            self._ended.popitem(last=False)

    def _sweep(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_sweep < min(1.0, self.idle_timeout_s / 4):
            return
        self._last_sweep = now
        limit = self.idle_timeout_s + self.expiry_grace_s
        if self.frontends_waiting:
            # one of them may be the chunk a stream waits for; but steady stream traffic must not keep abandoned
            # streams (and their max_streams places) for good: a chunk that waits a whole timeout is lost anyway
            limit += self.idle_timeout_s
        idle = [s for s in self._streams.values() if now - s.last_used > limit and not s.turn.busy]
        for state in idle:
            self.close(state, f"expired after {self.idle_timeout_s:g}s without a chunk (stream_idle_timeout_s)",
                       "expired")

    def release_gauges(self) -> None:
        """Stop setting the version's live-streams gauge: a reload's new copy owns it (see the scheduler's)."""
        self._owns_gauges = False

    def _gauge(self) -> None:
        if self._metrics is not None and self._owns_gauges:
            self._metrics.active_streams.labels(**self._labels).set(len(self._streams))

