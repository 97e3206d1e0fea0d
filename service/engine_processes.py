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
import os
import signal
from typing import Any

from .app import _serving, build_dataplane
from .children import run_child, start_beating
from .parent_death import die_with_parent
from .dataplane.remote import WAITING_REPORT_S, DataPlaneServer
from .settings import ServeSettings


def engine_socket(folder: str, index: int) -> str:
    """The Unix socket of engine process ``index`` in the server's private folder."""
    return os.path.join(folder, "engine.sock" if index == 0 else f"engine-{index}.sock")


class EngineHost:
    """One engine process's DataPlane served on its Unix socket: listening, loading the repository, drained.

    The supervisor (engine process 0) and every spawned engine process run the same lifecycle.
    """

    def __init__(self, settings: ServeSettings, socket_path: str) -> None:
        self.dataplane = build_dataplane(settings)
        # A stream's chunk can wait in a front-end's lane, unseen here, until the front-end's next report: streams
        # must not expire in that time (set before the models load, so every stream store gets it).
        self.dataplane.registry.stream_expiry_grace_s = 2 * WAITING_REPORT_S
        self.server = DataPlaneServer(self.dataplane, socket_path)
        self._drain_timeout_s = settings.drain_timeout_s
        self._load: asyncio.Task | None = None

    async def listen(self) -> None:
        """Accept front-end connections (models are not loaded yet: calls answer 'not ready')."""
        await self.server.start()

    def load(self) -> None:
        """Load the repository in the background."""
        self._load = asyncio.create_task(self.dataplane.start(), name="load-models")
        self._load.add_done_callback(_serving)

    async def stop(self) -> None:
        """Stop loading, finish the calls in flight and what waits in the schedulers."""
        self.dataplane.begin_drain()
        if self._load is not None and not self._load.done():
            self._load.cancel()
            with contextlib.suppress(BaseException):
                await self._load
        await self.server.stop(self._drain_timeout_s)
        await self.dataplane.stop(drain=True)


def run_engine_process(settings: dict[str, Any], socket_path: str, heartbeat: tuple[Any, int], started: Any) -> None:
    """Entry point of engine process 1..N-1 (spawned: CUDA starts fresh in it)."""
    run_child("engine", settings, _engine_process, socket_path, heartbeat, started)


async def _engine_process(settings: ServeSettings, socket_path: str, heartbeat: tuple[Any, int], started: Any) -> int:
    die_with_parent()
    stop = asyncio.Event()
    host = EngineHost(settings, socket_path)
    await host.listen()
    # Only the supervisor's SIGTERM stops an engine process: a Ctrl-C reaches the whole process group, and
    # the engine processes must keep serving the front-ends while those drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    start_beating(heartbeat)  # models build on threads of their own: loading does not hold the loop
    started.put(("ok", os.getpid()))
    host.load()
    await stop.wait()
    await host.stop()
    return 0
