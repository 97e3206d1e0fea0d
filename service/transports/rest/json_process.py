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


# A call's answer must come within HELPER_BASE_S plus HELPER_S_PER_MIB a MiB of its job (decoding runs at ~40 ms
# a MB on a development machine; this allows ~25x that, for slow and busy hosts). A helper that does not answer
# (stopped, wedged) is killed and replaced: before, every large JSON body waited on it for good while health
# checks, served by the event loop, stayed green.
HELPER_BASE_S = 10.0
HELPER_S_PER_MIB = 1.0
START_S = 30.0  # a helper's start (a spawned Python importing NumPy and rnnserve: ~1 s)


class JsonProcess:
    """Runs picklable functions of picklable arguments in one helper process, started on first use."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._pid: int | None = None  # the helper's, to kill one that does not answer
        self._finalizer: weakref.finalize | None = None
        self._on_thread = False  # no helper can start in this process: decode on a thread, as before

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the helper process; its exceptions (rnnserve's errors too) come back as raised.

        Where no helper can start (a spawned process re-imports the program's ``__main__``, which a program
        read from standard input, for one, does not have), it runs on a thread instead, with a warning.
        A helper found stopped before the call (killed while idle) is replaced and the call goes to the new one;
        one that stops during the call, or does not answer in time, fails the call with Unavailable.
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
            limit_s = HELPER_BASE_S + HELPER_S_PER_MIB * len(job) / 2**20
            try:
                answer = await asyncio.wait_for(asyncio.wrap_future(future), limit_s)
            except BrokenProcessPool:
                if self._on_thread:  # sent while the first body found that no helper can start here
                    return await asyncio.to_thread(fn, *args)
                raise self._stopped(pool) from None
            except TimeoutError:
                raise self._unanswered(pool, limit_s) from None
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

    def _stopped(self, pool: ProcessPoolExecutor) -> Unavailable:
        if pool is self._pool:  # not yet replaced by another call's: the next large body starts a new one
            log.warning("the JSON helper process stopped; a new one starts with the next large JSON body")
            self.close()
        return Unavailable("the server's JSON decoding process stopped while it handled this body (out of memory?); "
                           "send it again, in smaller requests, or as binary tensor data")

    def _unanswered(self, pool: ProcessPoolExecutor, limit_s: float) -> Unavailable:
        if pool is self._pool:
            log.warning("the JSON helper process (pid %s) did not answer within %.0f s (stopped or wedged); it is "
                        "killed and a new one starts with the next large JSON body", self._pid, limit_s)
            self.close(kill=True)
        return Unavailable(f"the server's JSON decoding process did not answer within {limit_s:.0f} s and was "
                           f"replaced; send the request again, or as binary tensor data")

    def close(self, wait: bool = False, kill: bool = False) -> None:
        """Stop the helper process, if any (a later call starts a new one); ``wait``: until it has exited;
        ``kill``: at once, with SIGKILL (one that does not answer would not take the pool's stop signal).

        A server stopping waits: a process exiting joins its children, and its exit also closes the queue
        that would carry the helper its stop signal, so a helper told to stop without waiting could be left
        waiting for work, and its parent with it.
        """
        pool, finalizer, pid = self._pool, self._finalizer, self._pid
        self._pool = self._finalizer = self._pid = None
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
