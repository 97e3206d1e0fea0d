"""The server's child processes (front-ends, extra engine processes): started, watched, stopped together."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
from typing import Any

from .errors import RNNServeError

START_TIMEOUT_S = 120.0


def die_with_parent() -> None:
    """Linux: get SIGTERM when the supervising process dies, however it dies (no orphaned children)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the socket-closed path still stops us
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def start_children(procs: list[multiprocessing.Process], started: Any, what: str) -> None:
    """Start ``procs`` and wait until each has put ("ok", pid) on ``started`` (an error raises)."""
    for proc in procs:
        proc.start()
    loop = asyncio.get_running_loop()
    for _ in procs:
        status, detail = await loop.run_in_executor(None, started.get, True, START_TIMEOUT_S)
        if status != "ok":
            raise RNNServeError(f"{what} failed to start: {detail}")


async def watch_children(procs: list[multiprocessing.Process]) -> None:
    """Return when any of ``procs`` has exited."""
    while all(p.is_alive() for p in procs):
        await asyncio.sleep(0.5)


async def stop_children(procs: list[multiprocessing.Process], grace: float) -> None:
    """SIGTERM ``procs``, wait up to ``grace`` + 5 s for each, then kill what is left."""
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    for proc in procs:
        if proc.pid is None:
            continue
        await loop.run_in_executor(None, proc.join, grace + 5)
        if proc.is_alive():
            proc.kill()
