"""Model builds on threads of their own, which a server that has stopped serving does not wait for.

A build (reading the weights, making the engine: cuDNN autotuning and graph captures take seconds
for a large model) runs off the event loop and cannot be interrupted. On asyncio's default
executor (``asyncio.to_thread``) the process joined it at exit: a SIGTERM during a load drained at
once, then waited for the load to end, past the grace period of Docker (10 s) or Kubernetes (30 s)
for a slow one, which then killed it. Builds run here instead, on daemon threads, and a process
that has finished serving calls :func:`exit_if_building`, which ends it at once when a build is
still running: a half-built engine is nothing to keep, and interpreter shutdown with a thread inside
CUDA or NumPy could crash instead of exiting with the server's code.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger("rnnserve.registry")
_building: set[threading.Thread] = set()


async def build_off_loop(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)`` on a daemon thread named ``name``, awaited; its exception is raised here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if done.done():  # the awaiting caller was cancelled: nobody reads it
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            outcome = (False, exc)
        finally:
            _building.discard(threading.current_thread())
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server has stopped
            loop.call_soon_threadsafe(settle, *outcome)

    thread = threading.Thread(target=run, name=name, daemon=True)
    _building.add(thread)
    thread.start()
    return await done


def exit_if_building(code: int) -> None:
    """End this process now with ``code`` when a model build is still running (see the module docstring)."""
    running = [t.name for t in list(_building) if t.is_alive()]
    if not running:
        return
    log.info("rnnserve: exiting without waiting for %s", ", ".join(sorted(running)))
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
