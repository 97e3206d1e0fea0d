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
import logging
import multiprocessing
import pickle
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

class JsonProcess:
    """Runs picklable functions of picklable arguments in one helper process, started on first use."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        self._on_thread = False  # no helper can start in this process: decode on a thread, as before

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the helper process; its exceptions (rnnserve's errors too) come back as raised.

        Where no helper can start (a spawned process re-imports the program's ``__main__``, which a program
        read from standard input, for one, does not have), it runs on a thread instead, with a warning.
        """
        if self._pool is None and not self._on_thread:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_helper_start)
            self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
            try:
                await asyncio.wrap_future(self._pool.submit(int))  # started and answering
            except BrokenProcessPool:
                self.close()
                self._on_thread = True
                log.warning("the JSON helper process could not start in this process; large JSON bodies are "
                            "decoded on a thread, which holds the event loop while each one decodes")
        if self._on_thread:
            return await asyncio.to_thread(fn, *args)
        # a body viewed in place pickles only as bytes
        args = tuple(bytes(a) if isinstance(a, memoryview) else a for a in args)
        try:
            answer = await asyncio.wrap_future(self._pool.submit(_call, pickle.dumps((fn, args), protocol=5)))
        except BrokenProcessPool:
            if self._on_thread:  # sent while the first body found that no helper can start here
                return await asyncio.to_thread(fn, *args)
            # it died (out of memory, killed): the next large body starts a new one
            log.warning("the JSON helper process stopped; a new one starts with the next large JSON body")
            self.close()
            raise Unavailable("the server's JSON decoding process stopped while it handled this body (out of "
                              "memory?); send it again, in smaller requests, or as binary tensor data") from None
        return pickle.loads(answer)

    def close(self, wait: bool = False) -> None:
        """Stop the helper process, if any (a later call starts a new one); ``wait``: until it has exited.

        A server stopping waits: a process exiting joins its children, and its exit also closes the queue
        that would carry the helper its stop signal, so a helper told to stop without waiting could be left
        waiting for work, and its parent with it.
        """
        pool, finalizer = self._pool, self._finalizer
        self._pool = self._finalizer = None
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
