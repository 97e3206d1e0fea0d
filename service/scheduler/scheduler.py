"""Scheduler: dynamic batching of ragged sequences for one model version.

Every request becomes a waiting item with a future. One worker task per model
forms batches and runs them in order on worker threads (so the event loop never
computes); the engine runs one batch at a time.

Batching policy
---------------
* Backpressure: at most ``max_queue_size`` requests wait; one more is refused at once
  with :class:`Unavailable` (HTTP 503, gRPC UNAVAILABLE).
* Window: a batch runs when the waiting requests hold ``max_batch_size`` sequences,
  or when the oldest has waited ``max_queue_delay_us``, whichever comes first. While a
  batch computes, new requests wait; the next batch is formed as soon as it finishes,
  or, for an engine that sets ``concurrent_batches = 2`` (the cuDNN engine), as soon as
  it starts: that batch then waits for the engine's lock in its worker thread and runs
  the moment the first is done, instead of after the event loop has answered the first
  batch's requests and come back (measured on an H200: a batch of ~22 took ~1.3 ms
  of engine work and ~4.6 ms of scheduler cycle).
  The default delay is 0: a lone request never waits for company (no added latency at
  low load), and under load the queue fills while the engine computes, which batches
  as well as a delay would; measured in bench/serve.py.
  With a batch already on the device, the next one is formed just in time: shortly
  before the device is predicted to be free (or at once when ``max_batch_size``
  sequences wait), so that requests arriving meanwhile still join it; see
  :mod:`.device_clock`.
* Grouping by length: when more sequences wait than fit in one batch, the waiting
  requests are ordered by their longest length and the batch is grown from the
  *oldest* request towards its nearest neighbours in length. Long sequences thus
  batch with long ones and short with short (a 200-step sequence does not hold 60
  ten-step ones for 200 steps), and the oldest request always runs next, so nothing
  starves. When everything waiting fits in one batch it runs as one batch: on a
  single worker, splitting would only add engine calls.
* Memory: a batch also holds at most ``max_batch_steps`` padded sequence-steps (rows x
  longest length), the model's :class:`~.memory_budget.MemoryBudget`. Validation refuses a
  request over it alone and front-ends merge within it; an item over it anyway runs alone.
* A request with more sequences than ``max_batch_size`` runs alone as one batch.
* Deadlines: a request's ``timeout`` (µs) bounds its time in the queue; when it
  passes before the batch starts, the request fails with :class:`DeadlineExceeded`
  and is never computed. Once running, a request completes.
* A batch that raises fails its own requests with the error (engine errors are
  wrapped with the model name and batch size); the scheduler keeps serving.

An engine that ``launches`` (the cuDNN engine) has each batch merged and queued on
the GPU from the event loop, and only the wait for the GPU runs on the worker thread;
the results are split on the event loop again. The batch's host work then runs in one
stretch: on a worker thread it had to win the GIL back from the busy event loop after
every launch and copy (see :meth:`service.engines.cudnn.CudnnEngine.launch`). A short batch
is waited for by polling its event from the event loop instead, which spares a request two
thread wake-ups (see :meth:`Scheduler._poll_device`).

Stateful streams need nothing special here: the dataplane fills ``SequenceWork.h0/c0``
from the :class:`~.streams.StreamStore` and keeps ``h_n/c_n`` from the result, and
submits a stream's chunks one at a time, so chunks of different streams batch
together and chunks of one stream never share a batch.
"""
from __future__ import annotations

import contextlib
import asyncio
import logging
import threading
import time
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DeadlineExceeded, RNNServeError, Unavailable
from ..metrics import ServerMetrics, observe_many
from .batching import SequenceWork, finish_batch, launch_batch, run_batch
from .device_clock import DeviceClock

log = logging.getLogger("rnnserve.scheduler")

_QUEUED, _RUNNING, _DROPPED = "queued", "running", "dropped"


@dataclass(eq=False)
class _Waiting:
    work: SequenceWork
    future: asyncio.Future
    enqueued: float
    deadline: float | None
    requests: int = 1
    state: str = _QUEUED
    queue_seconds: float = field(default=0.0)
    timer: asyncio.TimerHandle | None = None


class Scheduler:
    """Batches requests for one engine; ``submit`` returns the request's outputs by name."""

    # Batches predicted done within this many seconds are waited for by polling from the event loop (_poll_device).
    inline_wait_s = 1e-3

    def __init__(self, engine: Any, model: str, version: str, *, max_batch_size: int, max_queue_delay_us: int,
                 max_queue_size: int, max_batch_steps: int | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.model = model
        self.version = version
        self.max_batch_size = max_batch_size
        # rows x longest length one batch may hold (its memory budget, see .memory_budget); None: no bound
        self.max_batch_steps = max_batch_steps
        self.max_queue_delay = max_queue_delay_us / 1e6
        self.max_queue_size = max_queue_size
        self._metrics = metrics
        self._waiting: list[_Waiting] = []
        self._queued = 0  # sequences in self._waiting (read on every enqueue: no sum over the queue)
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._labels = {"model": model, "version": version}
        self._owns_gauges = True  # see release_gauges
        # Batches in flight: a GPU engine launches the next batch while the last one still runs (its
        # stream keeps them in order) or while the event loop is still answering the last one's requests.
        self._inflight = max(1, int(getattr(engine, "concurrent_batches", 1)))
        self._turn = threading.Lock()
        self._busy_until = 0.0
        # Just-in-time forming of the next batch while one runs (see device_clock).
        self._clock = DeviceClock() if self._inflight > 1 and getattr(engine, "launches", False) else None
        self._holding = False
        self._running: set[asyncio.Task] = set()  # tasks of the batches taken from the queue (see _poll_device)
        # Label lookups take a lock and hash the labels: bind this model's series once. The registry
        # removes the gauges only when the version goes away for good (not when a reload replaces it).
        self._series = None if metrics is None else SimpleNamespace(**{
            name: getattr(metrics, name).labels(**self._labels)
            for name in ("batch_failures", "compute_duration", "batch_size", "batch_timesteps",
                         "computed_timesteps", "useful_timesteps", "queue_duration", "queue_depth",
                         "computed_requests", "request_compute")})
        if metrics is not None:  # set by front-ends' reports (--frontends N); at 0 from the start, as queue_depth
            metrics.frontend_queue_depth.labels(**self._labels)

    @property
    def depth(self) -> int:
        """Requests waiting (not yet running)."""
        return len(self._waiting)

    async def start(self) -> None:
        """Start the worker task and thread."""
        self._executor = ThreadPoolExecutor(max_workers=self._inflight,
                                            thread_name_prefix=f"rnnserve-{self.model}-{self.version}")
        self._task = asyncio.create_task(self._loop(), name=f"scheduler-{self.model}-{self.version}")
        self._set_depth()

    async def stop(self, drain: bool = True) -> None:
        """Stop taking requests; run what waits (``drain``) or fail it with Unavailable; then stop."""
        self._closing = True
        if not drain:
            for item in self._waiting:
                self._finish(item, Unavailable(f"model '{self.model}' version {self.version} was unloaded"))
            self._waiting.clear()
            self._queued = 0
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def submit(self, work: SequenceWork, deadline: float | None = None) -> dict[str, np.ndarray]:
        """Queue ``work`` and wait for its outputs; ``deadline`` is a ``time.monotonic()`` value or None.

        Cancelling the wait takes the request out of the queue if it has not started.
        """
        return await self.enqueue(work, deadline)

    def enqueue(self, work: SequenceWork, deadline: float | None = None, requests: int = 1) -> asyncio.Future:
        """Queue ``work``; the returned future gets its outputs by name, or its error.

        ``requests``: how many client requests ``work`` holds (a front-end's merged work), for metrics.

        A future rather than a coroutine: the engine process answers front-end processes
        from a done-callback, without a task per request (measured on an H200 host, the
        event loop's per-request work was half of the engine process's GIL time).
        Cancelling the future takes the request out of the queue if it has not started.
        A ``deadline`` (``time.monotonic()`` value, comparable across processes) that
        passes while the request still waits fails it with DeadlineExceeded.
        """
        if self._closing or self._task is None:
            raise Unavailable(f"model '{self.model}' version {self.version} is not accepting requests (unloading)")
        if len(self._waiting) >= self.max_queue_size:
            raise Unavailable(
                f"model '{self.model}' is overloaded: {len(self._waiting)} requests are waiting "
                f"(max_queue_size {self.max_queue_size}); retry later"
            )
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            raise DeadlineExceeded(f"the request's timeout passed before model '{self.model}' could queue it; "
                                   f"raise the 'timeout' parameter")
        loop = asyncio.get_running_loop()
        item = _Waiting(work, loop.create_future(), now, deadline, requests)
        if deadline is not None:
            item.timer = loop.call_later(deadline - now, self._expire, item)
        item.future.add_done_callback(lambda _: self._settled(item))
        self._waiting.append(item)
        self._queued += work.sequences
        self._set_depth()
        if not self._holding or self._full():
            self._wake.set()
        return item.future

    def _full(self) -> bool:
        return self._queued >= self.max_batch_size

    def _expire(self, item: _Waiting) -> None:
        if item.state == _QUEUED:
            self._drop(item)
            self._finish(item, self._expired(item))

    def _settled(self, item: _Waiting) -> None:
        """The future is done (answered, failed, or cancelled by the caller): no timer, not queued."""
        if item.timer is not None:
            item.timer.cancel()
        if item.state == _QUEUED:
            self._drop(item)

    def _expired(self, item: _Waiting) -> DeadlineExceeded:
        waited = 1e6 * (time.monotonic() - item.enqueued)
        return DeadlineExceeded(
            f"the request's timeout ran out after it waited {waited:.0f} µs in the queue of model '{self.model}' "
            f"(a timeout counts from when the server read the request); raise the 'timeout' parameter or retry "
            f"when the server is less busy"
        )

    def _drop(self, item: _Waiting) -> None:
        was_queued, item.state = item.state == _QUEUED, _DROPPED
        if was_queued:
            with contextlib.suppress(ValueError):
                self._waiting.remove(item)
                self._queued -= item.work.sequences
        self._set_depth()

    def release_gauges(self) -> None:
        """Stop setting this version's queue-depth gauge: a reload's new copy of the version owns it now, and this
        copy's drain must not overwrite the new copy's value (the series is the version's, not the copy's)."""
        self._owns_gauges = False

    def _set_depth(self) -> None:
        if self._metrics is not None and self._owns_gauges:
            self._series.queue_depth.set(len(self._waiting))

    async def _loop(self) -> None:
        running = self._running
        while True:
            if self._waiting and len(running) < self._inflight:
                if running and await self._hold():
                    continue
                await self._batching_window()
                batch = self._take_batch()
                if batch:
                    task = asyncio.create_task(self._run(batch))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: self._wake.set())
                continue
            if self._closing and not self._waiting and not running:
                return
            self._wake.clear()
            await self._wake.wait()

    async def _hold(self) -> bool:
        """While a batch runs: wait until the device is nearly free (host-bound: until the batch
        ends), a batch is full or a batch ends.

        Returns whether it waited (the caller then looks at the queue again).
        """
        if self._clock is None or self._closing or self._full():
            return False
        delay = self._clock.form_at() - time.perf_counter()
        if delay <= 0 and not self._clock.host_bound():
            return False
        self._holding = True
        # host-bound: no timer, the running batch's end (or a full queue) wakes the loop
        timer = asyncio.get_running_loop().call_later(delay, self._wake.set) if delay > 0 else None
        try:
            self._wake.clear()
            await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()
            self._holding = False
        return True

    async def _batching_window(self) -> None:
        while self._waiting and not self._closing:
            if self._full():
                return
            remaining = self._waiting[0].enqueued + self.max_queue_delay - time.monotonic()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Waiting]:
        now = time.monotonic()
        for item in [w for w in self._waiting if w.deadline is not None and w.deadline <= now]:
            self._drop(item)
            self._finish(item, self._expired(item))
        if not self._waiting:
            return []
        chosen = self._choose(self._waiting)
        for item in chosen:
            item.state = _RUNNING
            item.queue_seconds = now - item.enqueued
            self._queued -= item.work.sequences
        # one pass, not a list.remove per chosen request (hundreds wait under stream load)
        self._waiting = [] if len(chosen) == len(self._waiting) else [w for w in self._waiting if w.state == _QUEUED]
        self._set_depth()
        return chosen

    def _choose(self, waiting: list[_Waiting]) -> list[_Waiting]:
        """Pick the next batch: everything if it fits (sequences and memory), else the oldest plus its nearest
        neighbours in length."""
        cap, budget = self.max_batch_size, self.max_batch_steps
        if self._queued <= cap and (budget is None or self._queued * max(w.work.steps for w in waiting) <= budget):
            return list(waiting)
        anchor = waiting[0]
        if anchor.work.sequences >= cap or (budget is not None and anchor.work.sequences * anchor.work.steps >= budget):
            return [anchor]
        by_len = sorted(waiting, key=lambda w: w.work.steps)
        pos = by_len.index(anchor)
        lo, hi, count = pos, pos + 1, anchor.work.sequences
        t0 = anchor.work.steps
        while True:
            left = by_len[lo - 1] if lo > 0 else None
            right = by_len[hi] if hi < len(by_len) else None
            # sorted by length: the batch's longest is its rightmost member (or the one being added on the right)
            longest = by_len[hi - 1].work.steps
            options = [c for c in (left, right) if c is not None and count + c.work.sequences <= cap
                       and (budget is None or (count + c.work.sequences) * max(longest, c.work.steps) <= budget)]
            if not options:
                break
            pick = min(options, key=lambda c: abs(c.work.steps - t0))
            count += pick.work.sequences
            if pick is left:
                lo -= 1
            else:
                hi += 1
        return by_len[lo:hi]

    def _timed_batch(self, parts: list[SequenceWork]) -> tuple[Any, list[dict[str, np.ndarray]], float]:
        with self._turn:  # one batch on the engine at a time; the time counts from its turn
            start = time.perf_counter()
            merged, results = run_batch(self.engine, parts)
            return merged, results, time.perf_counter() - start

    async def _launched_batch(self, parts: list[SequenceWork]) -> tuple[Any, list[dict[str, np.ndarray]], float]:
        """Merge and launch on this thread, wait (see :meth:`_poll_device`; else on a worker thread), split here
        (see Engine ``launches``)."""
        start = time.perf_counter()
        merged, launched = launch_batch(self.engine, parts)
        steps, returned = int(merged.x.shape[1]), time.perf_counter()
        if self._clock is not None:
            self._clock.launched(start, returned, steps)
        done = await self._poll_device(launched, returned)
        if done is None:
            done = await asyncio.get_running_loop().run_in_executor(self._executor, _wait, launched)
        if self._clock is not None:
            self._clock.finished(returned, done, steps)
        results = finish_batch(self.engine, merged, launched, parts)
        # Busy time without overlap: a batch launched while the previous one still ran counts from its end.
        end = time.perf_counter()
        elapsed, self._busy_until = end - max(start, self._busy_until), end
        return merged, results, elapsed

    async def _poll_device(self, launched: Any, returned: float) -> float | None:
        """Wait for a short batch by polling its event from the event loop; when its outputs were on the
        host, or None (then a worker thread waits).

        A worker thread waiting for the device hands the answer back to the loop, and that costs a
        request two thread wake-ups (H100 host, one 20..200-step sequence after 1 ms idle: 0.48 ms
        waited on the loop, 0.68 ms through a worker thread; bench/wait_path.py). The loop instead
        checks the batch's event once per iteration (a query, never a wait), so it keeps reading
        front-ends' messages and forming batches meanwhile: a version that blocked the loop in the
        wait lost binary HTTP a quarter of its throughput at concurrency 64 (H100 host, A/B), as
        the loop's time is what batches are made of. An idle loop spins while it polls, so it polls
        only batches that the device clock predicts done within ``inline_wait_s``, and for at most
        that long again (a batch slowed by another model's work on the device goes to a worker thread),
        and only a lone batch (nothing queued behind it, no other in flight): under load a loop
        iteration is long, and the device clock would learn its delay as device time.
        """
        clock, bound = self._clock, self.inline_wait_s
        # another batch in flight: launched and not yet waited for, or taken and not yet launched (its task
        # has not started); a finished task leaves the set a callback later
        others = sum(1 for task in self._running if not task.done()) > 1
        if (clock is None or clock.per_step is None or self._waiting or others
                or clock.free_at - returned > bound):
            return None
        give_up = time.perf_counter() + bound + max(0.0, clock.free_at - returned)  # predicted end, then the bound
        while not launched.ready():
            if time.perf_counter() > give_up:
                return None
            await asyncio.sleep(0)  # one loop iteration: I/O and callbacks run, then the event is queried again
        return time.perf_counter()

    async def _run(self, batch: list[_Waiting]) -> None:
        parts = [w.work for w in batch]
        loop = asyncio.get_running_loop()
        try:
            if getattr(self.engine, "launches", False):
                merged, results, elapsed = await self._launched_batch(parts)
            else:
                merged, results, elapsed = await loop.run_in_executor(self._executor, self._timed_batch, parts)
        except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the server
            sequences = sum(p.sequences for p in parts)
            if isinstance(exc, RNNServeError):
                error: RNNServeError = exc
            else:
                log.exception("model %s version %s: batch of %d sequences failed", self.model, self.version, sequences)
                error = RNNServeError(
                    f"model '{self.model}' version {self.version} failed on a batch of {sequences} sequences: "
                    f"{type(exc).__name__}: {exc}"
                )
            if self._series is not None:
                self._series.batch_failures.inc()
            for item in batch:
                self._finish(item, error)
            return
        if self._series is not None:
            m = self._series
            m.compute_duration.observe(elapsed)
            m.batch_size.observe(merged.x.shape[0])
            m.batch_timesteps.observe(merged.x.shape[1])
            m.computed_timesteps.inc(merged.computed_steps)
            m.useful_timesteps.inc(merged.useful_steps)
            requests = 0
            for item in batch:
                observe_many(m.queue_duration, item.queue_seconds, item.requests)
                requests += item.requests
            m.computed_requests.inc(requests)
            m.request_compute.inc(elapsed * requests)
        for item, result in zip(batch, results):
            if not item.future.done():
                item.future.set_result(result)

    @staticmethod
    def _finish(item: _Waiting, error: RNNServeError) -> None:
        if not item.future.done():
            item.future.set_exception(error)


def _wait(launched: Any) -> float:
    """Wait for a launched batch (worker thread); when its outputs were on the host."""
    launched.wait()
    return time.perf_counter()
