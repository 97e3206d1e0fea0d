"""JsonProcess: large JSON bodies are decoded, and large JSON answers encoded, in a helper process.

CPython's JSON decoder and encoder are C loops that keep the GIL for their whole run, as
does NumPy turning a list of Python floats into an array: on a worker thread they still
stopped every other request of the process (its event loop logged itself blocked for
240-280 ms while one 6.4 MB JSON body of 1.28 million numbers was decoded, development
machine; about 40 ms a MB). A process of its own decodes them while the event loop goes
on serving; the decoded arrays come back pickled (a copy, about a millisecond for 5 MB).
The process starts on the first large body (well under a second) and serves the REST
transport of this server process from then on; one at a time, since the DecodeGate
already bounds how much JSON is decoded at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import time
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, TypeVar

from ...errors import Unavailable
from ...metrics.processes import helper_name, name_this_process
from ...parent_death import die_with_parent

T = TypeVar("T")
log = logging.getLogger("rnnserve.transports.rest")


def _helper_start() -> None:
    """The helper process's first act: end with its parent, and take its name (``rnnserve_process_*`` metrics)."""
    die_with_parent()
    name_this_process(helper_name())


# A helper with work that has not used any CPU for STALL_S (stopped, wedged) is killed and replaced: before, every
# large JSON body waited on it for good while health checks, served by the event loop, stayed green. Progress, not a
# deadline: a healthy helper may take long over a queue of large bodies and answers (40 concurrent answers of 16 MB
# of JSON each took ~30 s on 2 cores), and every one of them must still be served.
STALL_S = 10.0
CHECK_S = 1.0  # how often a call waiting on the helper looks at its CPU time
START_S = 30.0  # a helper's start (a spawned Python importing NumPy and rnnserve: ~1 s)


class JsonProcess:
    """Runs picklable functions of picklable arguments in one helper process, started on first use."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._pid: int | None = None  # the helper's, to kill one that does not answer
        self._finalizer: weakref.finalize | None = None
        self._on_thread = False  # no helper can start in this process: decode on a thread, as before
        self._progress: tuple[int, float, float] | None = None  # helper CPU ticks, when they last moved, last look
        self._killed: weakref.WeakSet = weakref.WeakSet()  # pools whose helper was killed for making no progress

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the helper process; its exceptions (rnnserve's errors too) come back as raised.

        Where no helper can start (a spawned process re-imports the program's ``__main__``, which a program
        read from standard input, for one, does not have), it runs on a thread instead, with a warning.
        A helper found stopped before the call (killed while idle) is replaced and the call goes to the new one;
        one that stops during the call, or makes no progress for STALL_S, fails the call with Unavailable.
        """
        for _ in range(2):
            pool = await self._started()
            if pool is None:
                return await asyncio.to_thread(fn, *args)
            # a body viewed in place pickles only as bytes
            job = pickle.dumps((fn, tuple(bytes(a) if isinstance(a, memoryview) else a for a in args)), protocol=5)
            try:
                future = pool.submit(_call, job)
            except BrokenProcessPool:  # it had stopped before this call: not this body's doing
                log.warning("the JSON helper process had stopped; a new one starts for this body")
                self.close()
                continue
            try:
                answer = await self._answer(pool, future)
            except BrokenProcessPool:
                if self._on_thread:  # sent while the first body found that no helper can start here
                    return await asyncio.to_thread(fn, *args)
                raise self._stopped(pool) from None
            return pickle.loads(answer)
        raise Unavailable("the server's JSON decoding process stopped twice before it could take this body; send it "
                          "again, or as binary tensor data")

    async def _started(self) -> ProcessPoolExecutor | None:
        """The helper's pool, started (and answering) now if it is not; None where no helper can start here."""
        if self._pool is None and not self._on_thread:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_helper_start)
            self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
            try:  # started and answering; one stopped as it starts would hold every large body here
                self._pid = await asyncio.wait_for(asyncio.wrap_future(self._pool.submit(os.getpid)), START_S)
            except TimeoutError:
                stuck = list((getattr(self._pool, "_processes", None) or {}).values())  # CPython's pool keeps them here
                self.close()
                for process in stuck:
                    process.kill()
                raise Unavailable(f"the server's JSON decoding process did not start within {START_S:.0f} s; send "
                                  f"the request again, or as binary tensor data") from None
            except BrokenProcessPool:
                self.close()
                self._on_thread = True
                log.warning("the JSON helper process could not start in this process; large JSON bodies are "
                            "decoded on a thread, which holds the event loop while each one decodes")
        return self._pool

    async def _answer(self, pool: ProcessPoolExecutor, future: Any) -> bytes:
        """The job's pickled answer; Unavailable when the helper stops making progress (it is then replaced) or
        is replaced while the job waits (its queue is cancelled)."""
        waiting = asyncio.wrap_future(future)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=CHECK_S)
                if done:
                    break
                if self._stalled(pool):
                    self._kill(pool)
        except asyncio.CancelledError:
            future.cancel()  # the request went away: a job not yet started is dropped
            raise
        if waiting.cancelled():  # queued when the helper was replaced (pool.shutdown cancels what waits)
            raise Unavailable("the server's JSON decoding process stopped answering and was replaced while this body "
                              "waited for it; send it again")
        return waiting.result()

    def _stalled(self, pool: ProcessPoolExecutor) -> bool:
        """Whether ``pool``'s helper, which has work, has used no CPU for STALL_S (always False without /proc)."""
        if pool is not self._pool or self._pid is None:
            return False
        try:
            with open(f"/proc/{self._pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            used = int(fields[11]) + int(fields[12])  # utime + stime, fields 14 and 15 of proc(5)
        except (OSError, ValueError, IndexError):
            return False
        now = time.monotonic()
        if self._progress is None or self._progress[0] != used or now - self._progress[2] > 2 * CHECK_S:
            self._progress = (used, now, now)  # moved on, or first look since the helper was idle
            return False
        self._progress = (used, self._progress[1], now)
        return now - self._progress[1] > STALL_S

    def _kill(self, pool: ProcessPoolExecutor) -> None:
        log.warning("the JSON helper process (pid %s) has work and used no CPU for %.0f s (stopped or wedged); it is "
                    "killed and a new one starts with the next large JSON body", self._pid, STALL_S)
        self._killed.add(pool)
        self.close(kill=True)

    def _stopped(self, pool: ProcessPoolExecutor) -> Unavailable:
        if pool in self._killed:
            return Unavailable("the server's JSON decoding process stopped answering and was replaced while it "
                               "handled this body; send it again")
        if pool is self._pool:  # not yet replaced by another call's: the next large body starts a new one
            log.warning("the JSON helper process stopped; a new one starts with the next large JSON body")
            self.close()
        return Unavailable("the server's JSON decoding process stopped while it handled this body (out of memory?); "
                           "send it again, in smaller requests, or as binary tensor data")

    def close(self, wait: bool = False, kill: bool = False) -> None:
        """Stop the helper process, if any (a later call starts a new one); ``wait``: until it has exited;
        ``kill``: at once, with SIGKILL (one that does not answer would not take the pool's stop signal).

        A server stopping waits: a process exiting joins its children, and its exit also closes the queue
        that would carry the helper its stop signal, so a helper told to stop without waiting could be left
        waiting for work, and its parent with it.
        """
        pool, finalizer, pid = self._pool, self._finalizer, self._pid
        self._pool = self._finalizer = self._pid = self._progress = None
        if kill and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if finalizer is not None:
            finalizer.detach()
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)


def _call(job: bytes) -> bytes:
    """The helper process's side: ``fn(*args)`` from a pickled job, its answer pickled.

    Both ways travel as protocol 5 pickles made here, because rnnserve's tensors pickle their buffers
    out of band (:mod:`service.wire`), which multiprocessing's own pickling (protocol 4) refuses.
    """
    fn, args = pickle.loads(job)
    return pickle.dumps(fn(*args), protocol=5)
