"""The server's child processes (front-ends, extra engine processes): started, watched, stopped together."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
from typing import Any, Awaitable, Callable

from . import eventloop
from .errors import RNNServeError
from .heartbeats import WATCH_S, Heartbeats, beat
from .metrics.processes import name_this_process
from .registry.builds import exit_if_building
from .settings import ServeSettings

START_TIMEOUT_S = 120.0
log = logging.getLogger("rnnserve.children")
_beating: set[asyncio.Task] = set()


def run_child(role: str, settings: dict[str, Any], main: Callable[..., Awaitable[int]], *args: Any) -> None:
    """Body of a spawned child: logging tagged with ``role``, settings rebuilt, ``main(settings, *args)`` on the
    configured event loop, exit with its code. ``args[-1]`` is the ``started`` queue, which gets the error when
    the child cannot start."""
    # "frontend-3" -> rnnserve-fe-3 (15 bytes at most): the rnnserve_process_* metrics name processes so
    name_this_process("rnnserve-" + multiprocessing.current_process().name.replace("frontend", "fe").replace(
        "engine", "eng"))
    logging.basicConfig(level=settings.get("log_level", "info").upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[{role} %(process)d]: %(message)s")
    try:
        child_settings = ServeSettings(**settings)
        # Busy event loops must hand the GIL over quickly: to gRPC's poller thread in a front-end, to the
        # batch waits in an engine process (see the setting).
        sys.setswitchinterval(child_settings.gil_switch_interval_us / 1e6)
        code = eventloop.run(main(child_settings, *args), child_settings.event_loop)
    except Exception as exc:  # noqa: BLE001 - reported to the supervisor, which exits non-zero
        args[-1].put(("error", f"{type(exc).__name__}: {exc}"))
        code = 1
    exit_if_building(code)  # an engine process stopped during a model load
    raise SystemExit(code)


async def start_children(procs: list[multiprocessing.Process], started: Any, what: str) -> None:
    """Start ``procs`` and wait until each has put ("ok", pid) on ``started`` (an error raises)."""
    for proc in procs:
        proc.start()
    loop = asyncio.get_running_loop()
    for _ in procs:
        status, detail = await loop.run_in_executor(None, started.get, True, START_TIMEOUT_S)
        if status != "ok":
            raise RNNServeError(f"{what} failed to start: {detail}")


def start_beating(heartbeat: tuple[Any, int]) -> None:
    """In a child, once it serves: count in its heartbeat slot ``(counts, slot)`` (see :mod:`service.heartbeats`)."""
    task = asyncio.get_running_loop().create_task(beat(*heartbeat), name="heartbeat")
    _beating.add(task)
    task.add_done_callback(_beating.discard)


async def watch_children(procs: list[multiprocessing.Process], beats: Heartbeats | None = None,
                         timeout_s: float = 0.0) -> None:
    """Return when any of ``procs`` has exited; with ``beats`` (slot k: ``procs[k]``), also end the first whose
    event loop has not run for ``timeout_s`` (0: never) and return once it is gone."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while all(p.is_alive() for p in procs):
        await asyncio.sleep(WATCH_S)
        now = loop.time()
        elapsed, last = now - last, now
        stalled = beats.stalled(elapsed, timeout_s) if beats is not None else []
        if stalled:
            proc = procs[stalled[0]]
            log.error("%s (pid %s) has not run its event loop for %.0f s: it is stopped (SIGSTOP, a debugger) or "
                      "wedged, and holds its connections and requests; ending it, and the server with it "
                      "(--child-stall-timeout-s sets the limit, 0 turns this off)", proc.name, proc.pid, timeout_s)
            proc.kill()
            await loop.run_in_executor(None, proc.join, 10)
            return


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
