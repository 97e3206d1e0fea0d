"""`rnnserve serve --frontends N [--engines E]`: N front-end processes around E engine processes.

This process keeps the DataPlane of engine process 0 (engines, batching, streams,
metrics) and serves it on a Unix socket (:mod:`service.dataplane.remote`); with
``--engines E`` > 1 it first starts E-1 more engine processes
(:mod:`service.engine_processes`). Each front-end process runs the same REST and gRPC
transports as the single-process server over a RemoteDataPlane (or, with several
engine processes, a :class:`~service.dataplane.shards.ShardedDataPlane` over one per
engine process). They accept HTTP connections from one listening socket, the front-end
holding the fewest taking the next (:mod:`service.transports.rest.balanced_accept`; or, with
``--http-balance kernel``, each listens with SO_REUSEPORT and the kernel hashes connections to
them), and share the gRPC port through SO_REUSEPORT. The printed start line and SIGTERM handling are the
single-process ones: on SIGTERM the front-ends drain first (their requests still
reach the engines), then the engine processes run what waits and exit 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from typing import Any

from . import eventloop
from .app import SharedHTTP, Transports, announce, install_stop_handlers, remove_stop_handlers
from .children import run_child, start_beating, start_children, stop_children, watch_children
from .dataplane.remote import WAITING_REPORT_S, RemoteDataPlane
from .dataplane.shards import ShardedDataPlane
from .engine_processes import EngineHost, engine_socket, run_engine_process
from .heap import freeze_heap
from .heartbeats import Heartbeats
from .parent_death import die_with_parent
from .ports import PortClaim, bind_listener, claim_port
from .settings import ServeSettings
from .transports.rest.balanced_accept import ConnectionTable, shared_listener

log = logging.getLogger("rnnserve.frontends")


def run_frontend(settings: dict[str, Any], socket_paths: list[str], http_share: SharedHTTP | None,
                 heartbeat: tuple[Any, int], started: Any) -> None:
    """Entry point of one front-end process (spawned: it never touches CUDA)."""
    run_child("frontend", settings, _frontend, socket_paths, http_share, heartbeat, started)


async def _frontend(settings: ServeSettings, socket_paths: list[str], http_share: SharedHTTP | None,
                    heartbeat: tuple[Any, int], started: Any) -> int:
    die_with_parent()
    stop = asyncio.Event()
    arena_bytes = (settings.frontend_shm_mb << 20) // len(socket_paths)  # one arena per engine process
    remotes = [RemoteDataPlane(path, on_lost=stop.set, arena_bytes=arena_bytes) for path in socket_paths]
    dataplane: RemoteDataPlane | ShardedDataPlane = remotes[0] if len(remotes) == 1 else ShardedDataPlane(
        remotes, lock_folder=os.path.dirname(socket_paths[0]))
    await dataplane.connect()
    transports = await Transports.start(dataplane, settings, reuse_port=True, http_share=http_share)
    install_stop_handlers(stop)
    freeze_heap()
    eventloop.start_stall_watch()
    start_beating(heartbeat)
    reporter = asyncio.create_task(_report_waiting(dataplane), name="report-waiting")
    started.put(("ok", os.getpid()))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, transports.http_task}, return_when=asyncio.FIRST_COMPLETED)
    dataplane.begin_drain()
    await transports.drain(settings)
    stopper.cancel()
    reporter.cancel()
    remove_stop_handlers()
    await dataplane.close()
    return 0


async def _report_waiting(dataplane: RemoteDataPlane | ShardedDataPlane) -> None:
    """Report the requests waiting in this front-end to the engine processes every :data:`WAITING_REPORT_S`
    (``rnnserve_frontend_queue_depth``; a report goes only when the counts changed)."""
    while True:
        await asyncio.sleep(WAITING_REPORT_S)
        dataplane.report_waiting()


async def serve_with_frontends(settings: ServeSettings, stop_event: asyncio.Event | None = None) -> int:
    """Run engine process 0 with ``settings.engines - 1`` more engine processes and ``settings.frontends``
    front-end processes until SIGTERM/SIGINT."""
    host_name = settings.host
    # held until the front-ends are gone, so that no other server joins their ports (see service.ports)
    http_listener = None
    if settings.http_balance == "connections":
        # one listening socket that every front-end accepts from (see transports.rest.balanced_accept); it holds
        # the port itself, so no other server can join it
        http_listener = shared_listener(bind_listener(host_name, settings.http_port, flag="--http-port"))
        claims: list[PortClaim] = [PortClaim(http_listener.getsockname()[1], None)]
    else:
        claims = [claim_port(host_name, settings.http_port, flag="--http-port")]
    http_port = claims[0].port
    grpc_port = settings.grpc_port
    if grpc_port >= 0:
        try:
            claims.append(claim_port(host_name, grpc_port, avoid=http_port, flag="--grpc-port"))
        except BaseException:
            claims[0].close()
            if http_listener is not None:
                http_listener.close()
            raise
        grpc_port = claims[1].port
    child_settings = settings.model_dump(mode="json") | {"http_port": http_port, "grpc_port": grpc_port,
                                                         "frontends": 1, "engines": 1}
    folder = tempfile.mkdtemp(prefix="rnnserve-")
    sockets = [engine_socket(folder, k) for k in range(settings.engines)]
    host = EngineHost(settings, sockets[0])
    await host.listen()
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Queue()
    beats = Heartbeats(ctx, settings.engines - 1 + settings.frontends)  # slot k: (engines + frontends)[k]
    engines = [ctx.Process(target=run_engine_process, args=(child_settings, path, (beats.counts, k - 1), started),
                           name=f"engine-{k}")
               for k, path in enumerate(sockets[1:], start=1)]
    table = ConnectionTable(settings.frontends, ctx) if http_listener is not None else None
    frontends = [ctx.Process(target=run_frontend, name=f"frontend-{k}",
                             args=(child_settings, sockets, None if table is None else (http_listener, table, k),
                                   (beats.counts, len(engines) + k), started))
                 for k in range(settings.frontends)]
    stop = stop_event or asyncio.Event()
    install_stop_handlers(stop)
    dead: list[str] = []
    try:
        await start_children(engines, started, "an engine process")
        await start_children(frontends, started, "a front-end process")
        grpc_phrase = f"gRPC on {host_name}:{grpc_port}" if grpc_port >= 0 else "gRPC off (--grpc-port -1)"
        line = f"rnnserve: HTTP on {host_name}:{http_port}, {grpc_phrase}"
        announce(line)
        log.info("%s; %d front-end and %d engine processes; loading models from %s on device %s", line,
                 len(frontends), settings.engines, settings.repository, settings.device)
        host.load()
        watch = asyncio.create_task(watch_children(engines + frontends, beats, settings.child_stall_timeout_s))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({stopper, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and not stop.is_set():
            dead = [_how_it_ended(p) for p in engines + frontends if not p.is_alive()]
        watch.cancel()
        stopper.cancel()
        log.info("rnnserve: draining in-flight requests (up to %gs)", settings.drain_timeout_s)
        host.dataplane.begin_drain()
        if http_listener is not None:
            # with the front-ends' copies (closed as they drain) gone, new connections are refused at once rather
            # than left waiting in the backlog for the whole drain
            http_listener.close()
    finally:
        await stop_children(frontends, settings.drain_timeout_s)  # first: their requests still reach the engines
        # together: each finishes what its front-ends sent within the drain timeout (one after another, a load
        # still building held the server three timeouts)
        await asyncio.gather(stop_children(engines, settings.drain_timeout_s), host.stop())
        remove_stop_handlers()
        shutil.rmtree(folder, ignore_errors=True)
        for claim in claims:
            claim.close()
        if http_listener is not None:
            http_listener.close()
    if dead:
        log.error("rnnserve: a child process exited unexpectedly: %s", ", ".join(dead))
        return 1
    log.info("rnnserve: stopped")
    return 0


def _how_it_ended(proc: multiprocessing.Process) -> str:
    """``frontend-0 (killed by SIGKILL)``, ``engine-1 (exit code 1)``: which child ended, and how, so that the one
    that failed stands apart from those that stopped because it did."""
    code = proc.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{proc.name} (killed by {signal.Signals(-code).name})"
    return f"{proc.name} (exit code {code})"
