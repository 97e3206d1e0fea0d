"""`rnnserve serve --frontends N`: N front-end processes around one engine process.

This process keeps the one DataPlane (engines, batching, streams, metrics) and serves
it on a Unix socket (:mod:`service.dataplane.remote`). Each front-end process runs the
same REST and gRPC transports as the single-process server over a RemoteDataPlane,
with the ports shared through SO_REUSEPORT, so the kernel spreads connections over the
front-ends. The printed start line and SIGTERM handling are the single-process ones:
on SIGTERM the front-ends drain first (their requests still reach the engines), then
the engine process runs what waits and exits 0.
"""
from __future__ import annotations

import contextlib
import asyncio
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import eventloop
from .app import Transports, _free_port, _serving, build_dataplane, install_stop_handlers, remove_stop_handlers
from .dataplane.remote import DataPlaneServer, RemoteDataPlane
from .errors import RNNServeError
from .heap import freeze_heap
from .settings import ServeSettings

log = logging.getLogger("rnnserve.frontends")
START_TIMEOUT_S = 120.0


def run_frontend(settings: dict[str, Any], socket_path: str, started: Any) -> None:
    """Entry point of one front-end process (spawned: it never touches CUDA)."""
    logging.basicConfig(level=settings.get("log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s[frontend %(process)d]: %(message)s")
    try:
        fe_settings = ServeSettings(**settings)
        # gRPC's poller thread must get the GIL from the busy event loop for every call it completes.
        sys.setswitchinterval(fe_settings.gil_switch_interval_us / 1e6)
        code = eventloop.run(_frontend(fe_settings, socket_path, started), fe_settings.event_loop)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits non-zero
        started.put(("error", f"{type(exc).__name__}: {exc}"))
        code = 1
    raise SystemExit(code)


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the engine process dies, however it dies (no orphaned front-ends)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the socket-closed path still stops us
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _frontend(settings: ServeSettings, socket_path: str, started: Any) -> int:
    _die_with_parent()
    stop = asyncio.Event()
    dataplane = RemoteDataPlane(socket_path, on_lost=stop.set)
    await dataplane.connect()
    transports = await Transports.start(dataplane, settings, reuse_port=True)
    install_stop_handlers(stop)
    freeze_heap()
    eventloop.start_stall_watch()
    started.put(("ok", os.getpid()))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, transports.http_task}, return_when=asyncio.FIRST_COMPLETED)
    dataplane.begin_drain()
    await transports.drain(settings)
    stopper.cancel()
    remove_stop_handlers()
    await dataplane.close()
    return 0


async def serve_with_frontends(settings: ServeSettings, stop_event: asyncio.Event | None = None) -> int:
    """Run the engine process with ``settings.frontends`` front-end processes until SIGTERM/SIGINT."""
    host = settings.host
    http_port = settings.http_port or _free_port(host)
    grpc_port = settings.grpc_port if settings.grpc_port != 0 else _free_port(host)
    child_settings = settings.model_dump(mode="json") | {"http_port": http_port, "grpc_port": grpc_port,
                                                         "frontends": 1}
    folder = tempfile.mkdtemp(prefix="rnnserve-")
    socket_path = str(Path(folder) / "engine.sock")
    dataplane = build_dataplane(settings)
    server = DataPlaneServer(dataplane, socket_path)
    await server.start()
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Queue()
    procs = [ctx.Process(target=run_frontend, args=(child_settings, socket_path, started), name=f"frontend-{k}")
             for k in range(settings.frontends)]
    stop = stop_event or asyncio.Event()
    install_stop_handlers(stop)
    load_task = None
    try:
        for proc in procs:
            proc.start()
        loop = asyncio.get_running_loop()
        for _ in procs:
            status, detail = await loop.run_in_executor(None, started.get, True, START_TIMEOUT_S)
            if status != "ok":
                raise RNNServeError(f"a front-end process failed to start: {detail}")
        grpc_phrase = f"gRPC on {host}:{grpc_port}" if grpc_port >= 0 else "gRPC off (--grpc-port -1)"
        line = f"rnnserve: HTTP on {host}:{http_port}, {grpc_phrase}"
        print(line, flush=True)
        log.info("%s; %d front-end processes; loading models from %s on device %s", line, len(procs),
                 settings.repository, settings.device)
        load_task = asyncio.create_task(dataplane.start(), name="load-models")
        load_task.add_done_callback(_serving)
        watch = asyncio.create_task(_watch(procs))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({stopper, watch}, return_when=asyncio.FIRST_COMPLETED)
        failed = watch.done() and not stop.is_set()
        watch.cancel()
        stopper.cancel()
        log.info("rnnserve: draining in-flight requests (up to %.0fs)", settings.drain_timeout_s)
        dataplane.begin_drain()
    finally:
        await _stop_frontends(procs, settings.drain_timeout_s)
        if load_task is not None and not load_task.done():
            load_task.cancel()
        await server.stop()
        await dataplane.stop(drain=True)
        remove_stop_handlers()
        shutil.rmtree(folder, ignore_errors=True)
    if failed:
        log.error("rnnserve: a front-end process exited unexpectedly")
        return 1
    log.info("rnnserve: stopped")
    return 0


async def _watch(procs: list[multiprocessing.Process]) -> None:
    """Return when any front-end process has exited."""
    while all(p.is_alive() for p in procs):
        await asyncio.sleep(0.5)


async def _stop_frontends(procs: list[multiprocessing.Process], grace: float) -> None:
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
