"""Composition root of `rnnserve serve`: settings -> metrics -> registry -> dataplane -> REST + gRPC.

One process, one asyncio event loop: uvicorn serves the FastAPI app and grpc.aio
serves gRPC side by side. The servers bind first and print one parseable line::

    rnnserve: HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001

(``gRPC off (...)`` when the gRPC transport is unavailable or ``--grpc-port -1``);
then models load in the background: the server is live at once and ready when
every loadable model is. SIGTERM or SIGINT starts a drain: readiness turns false,
both transports stop accepting and finish in-flight requests (up to
``--drain-timeout-s``; requests still running then get 503 or UNAVAILABLE), the
schedulers run what still waits, and the process exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any, Iterator

import uvicorn
from prometheus_client import CollectorRegistry

from . import eventloop
from .dataplane import DataPlane
from .engines.factory import cuda_problem
from .errors import RNNServeError
from .heap import freeze_heap
from .metrics import ServerMetrics
from .metrics.processes import PREFIX as PROCESS_NAME, name_this_process
from .ports import bind_listener
from .registry import DEFAULTED_FIELDS, ModelRegistry
from .registry.builds import exit_if_building
from .repository.root_check import repository_problem
from .settings import ServeSettings
from .transports.rest import create_rest_app
from .transports.rest.balanced_accept import BalancedAcceptor, ConnectionTable
from .transports.rest.head_guard import head_guard, http_connection_cap

# a listening socket shared by the front-end processes, their connection table, and one's slot in it
SharedHTTP = tuple[socket.socket, ConnectionTable, int]

log = logging.getLogger("rnnserve.app")
# How long a stopping server waits for the requests cut off at the drain timeout to send their 503 (each is one
# small write once its task runs; the bound only guards against a client that does not read).
_CUT_OFF_ANSWER_S = 1.0


def build_dataplane(settings: ServeSettings) -> DataPlane:
    """Metrics registry, model registry and dataplane for ``settings`` (nothing is loaded yet)."""
    metrics = ServerMetrics(CollectorRegistry())
    _watch_device(metrics, settings.device)
    defaults = {k: getattr(settings, k) for k in DEFAULTED_FIELDS}
    registry = ModelRegistry(settings.repository, settings.device, defaults, metrics)
    return DataPlane(registry, metrics)


def _watch_device(metrics: ServerMetrics, device: str) -> None:
    """Device memory rnnserve holds, and on a GPU the GPU's own counters (NVML), at every scrape."""
    if device != "cpu":
        try:
            import cupy  # noqa: F401 - only present with the gpu extra

            metrics.watch_device_memory("cuda:0", lambda: float(cupy.get_default_memory_pool().used_bytes()))
        except Exception as exc:  # noqa: BLE001 - no CUDA stack: report the CPU
            log.debug("device memory metric: no CuPy (%s); reporting the CPU", exc)
        else:
            try:
                from .engines.cudnn.nvml import GpuCounters

                gpu = GpuCounters.open(cupy.cuda.runtime.deviceGetPCIBusId(0))
            except cupy.cuda.runtime.CUDARuntimeError as exc:  # CuPy but no usable GPU (--device auto)
                log.debug("GPU metrics: no GPU (%s)", exc)
                gpu = None
            if gpu is not None:
                metrics.watch_gpu("cuda:0", gpu)
            return
    metrics.watch_device_memory("cpu", lambda: 0.0)


class _UvicornServer(uvicorn.Server):
    """uvicorn.Server without its own signal handling: :func:`serve` drains both transports itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def protocol_factory(self) -> asyncio.Protocol:
        """uvicorn's protocol for one connection accepted elsewhere (as its own listeners make them)."""
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,
                                               app_state=self.lifespan.state)


def announce(line: str) -> None:
    """Print ``line`` (the ports line that scripts and tests read) in one write.

    Child processes log to the same stream; ``print`` writes the text and its newline
    separately when the stream is unbuffered (PYTHONUNBUFFERED), and a child's line landing
    between them ran a port into a timestamp ("gRPC on 127.0.0.1:449672026-11-23 ...").
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _create_grpc(dataplane: DataPlane, settings: ServeSettings, reuse_port: bool) -> tuple[Any, str]:
    """The gRPC server, bound and not started (None when off); and its 'gRPC on ...' / 'gRPC off (...)' phrase."""
    if settings.grpc_port < 0:
        return None, "gRPC off (--grpc-port -1)"
    try:
        from .transports.grpc import create_grpc_server
    except ImportError as exc:
        log.warning("gRPC transport is not available (%s); serving REST only", exc)
        return None, f"gRPC off (transport not available: {exc})"
    from .transports.grpc.limits import GrpcLimits
    limits = GrpcLimits.of(settings.max_grpc_calls, settings.max_grpc_connections, settings.body_timeout_s)
    server = create_grpc_server(dataplane, settings.host, settings.grpc_port,
                                max_message_bytes=settings.max_request_bytes, reuse_port=reuse_port, limits=limits)
    log.info("%s", limits.describe(settings.max_request_bytes))
    return server, f"gRPC on {settings.host}:{server.bound_port}"


class Transports:
    """REST and gRPC servers over one dataplane, started and drained together."""

    def __init__(self, http: _UvicornServer, http_task: asyncio.Task, http_port: int, grpc_server: Any,
                 grpc_phrase: str, acceptor: BalancedAcceptor | None = None) -> None:
        self.http, self.http_task, self.http_port = http, http_task, http_port
        self.rest_app = http.config.app
        self.grpc_server, self.grpc_phrase = grpc_server, grpc_phrase
        self.acceptor = acceptor

    @classmethod
    async def start(cls, dataplane: Any, settings: ServeSettings, reuse_port: bool = False,
                    http_share: SharedHTTP | None = None) -> "Transports":
        """Bind and start both servers (``reuse_port``: share the ports with sibling front-end processes).

        ``http_share``: (listening socket, connection table, this front-end's slot): accept HTTP connections
        from a socket shared with the sibling front-ends, evenly (see :mod:`.transports.rest.balanced_accept`).
        """
        if http_share is not None:
            sock = http_share[0]
        else:
            sock = bind_listener(settings.host, settings.http_port, reuse_port, flag="--http-port")
        http_port = sock.getsockname()[1]
        try:
            # bound before HTTP serves anything, so that a taken gRPC port fails the start at once
            grpc_server, grpc_phrase = _create_grpc(dataplane, settings, reuse_port)
        except RNNServeError:
            sock.close()
            raise
        except Exception as exc:
            sock.close()
            raise RNNServeError(f"the gRPC server could not start: {exc}") from exc
        rest_app = create_rest_app(dataplane, settings.max_request_bytes, settings.body_timeout_s)
        # log_config None: uvicorn's own lines ("Invalid HTTP request received", its access lines at debug) go
        # through rnnserve's handler and format, not its own "INFO:     " ones
        config = uvicorn.Config(rest_app, lifespan="off", log_config=None,
                                http=head_guard(settings.body_timeout_s, http_connection_cap(settings.max_http_connections)),
                                log_level=settings.log_level, access_log=settings.log_level == "debug",
                                timeout_graceful_shutdown=settings.drain_timeout_s)
        http = _UvicornServer(config)
        http_task = asyncio.create_task(http.serve(sockets=[] if http_share else [sock]), name="http")
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            if grpc_server is not None:
                await grpc_server.stop(None)
            http_task.result()
            raise RNNServeError("the HTTP server stopped during startup")
        try:
            if grpc_server is not None:
                await grpc_server.start()
        except Exception as exc:
            http.should_exit = True
            await http_task
            raise RNNServeError(f"the gRPC server could not start: {exc}") from exc
        acceptor = None
        if http_share is not None:
            acceptor = BalancedAcceptor(sock, http_share[1], http_share[2], http.protocol_factory)
            acceptor.start()
        return cls(http, http_task, http_port, grpc_server, grpc_phrase, acceptor)

    async def drain(self, settings: ServeSettings) -> None:
        """Stop accepting and let in-flight requests finish (up to --drain-timeout-s).

        Requests still running at the timeout are cut off with an answer a client can retry elsewhere:
        REST 503 with the service's JSON error
        (:meth:`~service.transports.rest.infer.InferFastPath.begin_drain`), gRPC UNAVAILABLE with the same message
        (:mod:`.transports.grpc.calls`).
        """
        self.rest_app.begin_drain(settings.drain_timeout_s)
        if self.acceptor is not None:
            self.acceptor.close()
        self.http.should_exit = True
        waits = [self.http_task]
        if self.grpc_server is not None:
            waits.append(asyncio.create_task(self.grpc_server.stop(settings.drain_timeout_s)))
        await asyncio.gather(*waits, return_exceptions=True)
        # uvicorn cancels the requests still running at the timeout and returns without waiting for them: give
        # their tasks the moment they take to send their 503 before the process goes on to exit
        cut_off = set(self.http.server_state.tasks)
        if cut_off:
            await asyncio.wait(cut_off, timeout=_CUT_OFF_ANSWER_S)
        await asyncio.to_thread(self.rest_app.close)

    def failed(self) -> BaseException | None:
        """The HTTP server's error if it stopped by itself."""
        task = self.http_task
        return task.exception() if task.done() and not task.cancelled() else None


def install_stop_handlers(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Not possible on Windows' loops (NotImplementedError) or off the main thread (RuntimeError, e.g.
        # a server started inside a test thread): that server is stopped through its stop event instead.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


def remove_stop_handlers() -> None:
    """Undo :func:`install_stop_handlers` (where it could install them: the same two cases)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(sig)


async def serve(settings: ServeSettings, dataplane: DataPlane | None = None,
                stop_event: asyncio.Event | None = None) -> int:
    """Run the server until SIGTERM/SIGINT (or ``stop_event``), drain, and return the exit code."""
    # The batch worker thread gives up the GIL in every cuDNN launch, copy and wait, then waits up to
    # the switch interval for the event loop to hand it back, several times a batch (see the setting).
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    if (settings.frontends > 1 or settings.engines > 1) and dataplane is None:
        from .frontends import serve_with_frontends

        return await serve_with_frontends(settings, stop_event)
    dataplane = dataplane or build_dataplane(settings)
    stop = stop_event or asyncio.Event()
    transports = await Transports.start(dataplane, settings)
    line = f"rnnserve: HTTP on {settings.host}:{transports.http_port}, {transports.grpc_phrase}"
    announce(line)
    log.info("%s; loading models from %s on device %s", line, settings.repository, settings.device)

    install_stop_handlers(stop)
    load_task = asyncio.create_task(dataplane.start(), name="load-models")
    load_task.add_done_callback(_serving)
    load_task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error(
        "loading the repository failed: %s", t.exception()))

    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, transports.http_task}, return_when=asyncio.FIRST_COMPLETED)
    log.info("rnnserve: draining in-flight requests (up to %gs)", settings.drain_timeout_s)
    dataplane.begin_drain()
    await transports.drain(settings)
    stopper.cancel()
    if not load_task.done():
        load_task.cancel()
        with contextlib.suppress(BaseException):
            await load_task
    await dataplane.stop(drain=True)
    remove_stop_handlers()
    if transports.failed() is not None and not stop.is_set():
        log.error("rnnserve: the HTTP server failed: %s", transports.failed())
        return 1
    log.info("rnnserve: stopped")
    return 0


def _serving(_: Any) -> None:
    """Models loaded: freeze the heap (see service.heap) and watch the event loop for stalls."""
    freeze_heap()
    eventloop.start_stall_watch()


def serve_main(argv: list[str]) -> int:
    """`rnnserve serve [flags]`: parse settings (flags over RNNSERVE_* env vars) and serve."""
    try:
        settings = ServeSettings.from_args(argv)
    except RNNServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if (problem := repository_problem(settings.repository)) is not None:
        # Triton stops here too: a server with no models would report ready and take traffic it can only refuse.
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if settings.device == "cuda" and (problem := cuda_problem()) is not None:
        print(f"error: --device cuda cannot serve here: {problem}; serve with --device auto (cuDNN where it "
              f"works, else NumPy) or --device cpu", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.log_level.upper())
    name_this_process(PROCESS_NAME)
    # grpc-core writes its own error lines, one for every connection a client sends a malformed header on (a
    # probe: 530 kB of log a second); they are off unless asked for (--log-level debug, or GRPC_VERBOSITY set).
    # Set before grpc is first imported (here or in a child, which inherits it).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR" if settings.log_level == "debug" else "NONE")
    try:
        code = eventloop.run(serve(settings), settings.event_loop)
    except RNNServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        code = 1
    exit_if_building(code)
    return code
