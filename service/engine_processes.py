"""`rnnserve serve --engines N`: the engine processes beyond the first.

The process started by the user is engine process 0 (and supervises everything); it
spawns N-1 more, each with its own DataPlane (every model loaded, its own batching,
streams and metrics) served on its own Unix socket, before the front-ends start, so a
front-end finds every socket listening. Each loads the repository itself, so the
server is ready when every process is (the front-ends ask them all). On SIGTERM from
the supervisor (after the front-ends have drained) a process drains what still
waits in its schedulers and exits 0; it gets SIGTERM too when the supervisor dies.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from . import eventloop
from .app import _serving, build_dataplane
from .children import die_with_parent
from .dataplane.remote import DataPlaneServer
from .settings import ServeSettings

log = logging.getLogger("rnnserve.engines")


def engine_socket(folder: str, index: int) -> str:
    """The Unix socket of engine process ``index`` in the server's private folder."""
    return os.path.join(folder, "engine.sock" if index == 0 else f"engine-{index}.sock")


def run_engine_process(settings: dict[str, Any], socket_path: str, started: Any) -> None:
    """Entry point of engine process 1..N-1 (spawned: CUDA starts fresh in it)."""
    logging.basicConfig(level=settings.get("log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s[engine %(process)d]: %(message)s")
    try:
        engine_settings = ServeSettings(**settings)
        code = eventloop.run(_engine_process(engine_settings, socket_path, started), engine_settings.event_loop)
    except Exception as exc:  # noqa: BLE001 - reported to the supervisor, which exits non-zero
        started.put(("error", f"{type(exc).__name__}: {exc}"))
        code = 1
    raise SystemExit(code)


async def _engine_process(settings: ServeSettings, socket_path: str, started: Any) -> int:
    die_with_parent()
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    stop = asyncio.Event()
    dataplane = build_dataplane(settings)
    server = DataPlaneServer(dataplane, socket_path)
    await server.start()
    # Only the supervisor's SIGTERM stops an engine process: a Ctrl-C reaches the whole process group, and
    # the engine processes must keep serving the front-ends while those drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    started.put(("ok", os.getpid()))
    load_task = asyncio.create_task(dataplane.start(), name="load-models")
    load_task.add_done_callback(_serving)
    await stop.wait()
    dataplane.begin_drain()
    if not load_task.done():
        load_task.cancel()
        with contextlib.suppress(BaseException):
            await load_task
    await server.stop()
    await dataplane.stop(drain=True)
    return 0
