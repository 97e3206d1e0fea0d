"""Build the gRPC server: GRPCInferenceService, grpc.health.v1, error mapping, limits."""
from __future__ import annotations

import asyncio
import contextlib

from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from ...errors import cut_off_by_drain
from ...ports import bind_listener, listen_error
from .calls import CallTracker
from .limits import GrpcLimits
from . import late_answers
from .generated import inference_pb2 as pb
from .servicer import InferenceServicer
from .status import register
from .unserved import UnservedMethods

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVICE_NAME = "inference.GRPCInferenceService"
# How often Watch subscribers of the health service see readiness changes.
HEALTH_POLL_SECONDS = 1.0
# grpc's own cancel of the calls left at the drain's end comes this long after the service's answer to them
GRPC_GRACE_MARGIN_S = 1.0


class ReadinessHealthServicer(health_aio.HealthServicer):
    """grpc.health.v1 Health: SERVING while ``dataplane.ready()``, else NOT_SERVING.

    Answers for the server ("") and for ``inference.GRPCInferenceService``. Check
    and the start of Watch read readiness at call time; Watch subscribers then see
    changes as :meth:`refresh` runs (every ``HEALTH_POLL_SECONDS`` while the server
    runs).
    """

    def __init__(self, dataplane) -> None:
        super().__init__()
        self._dataplane = dataplane

    async def refresh(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            status = serving if await self._dataplane.ready() else not_serving
        except Exception:
            status = not_serving
        for service in ("", SERVICE_NAME):
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)

    async def Watch(self, request, context):
        """The base class's Watch, except that a watch ends once the server stops and NOT_SERVING is sent: an
        open watch held the drain to its timeout, and then was told it had not finished in time."""
        await self.refresh()
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        try:
            async with condition:
                last = None
                while True:
                    status = self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                        last = status
                    if self._gracefully_shutting_down:
                        if last != health_pb2.HealthCheckResponse.NOT_SERVING:
                            # woken with the shutdown begun but its NOT_SERVING not yet recorded (once in CI a watch
                            # ended with nothing after SERVING): the watcher must hear NOT_SERVING before the end
                            await context.write(health_pb2.HealthCheckResponse(
                                status=health_pb2.HealthCheckResponse.NOT_SERVING))
                        return
                    await condition.wait()
        finally:
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, and every watch woken to send it and end (a watch of a service
        nobody sets was never woken)."""
        await super().enter_graceful_shutdown()
        for condition in list(self._server_watchers.values()):
            async with condition:
                condition.notify_all()


class GRPCServer:
    """A ``grpc.aio.Server`` with its bound port and the health poller.

    Awaitable like the server it wraps (``await start()``, ``await stop(grace)``,
    ``await wait_for_termination()``); other attributes pass through to
    :attr:`server`.
    """

    def __init__(self, server: aio.Server, bound_port: int, health: ReadinessHealthServicer,
                 calls: CallTracker | None = None, inference: InferenceServicer | None = None) -> None:
        self.server = server
        self.bound_port = bound_port
        self._health = health
        self._inference = inference
        self._calls = calls if calls is not None else CallTracker()
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        await self._health.refresh()
        await self.server.start()
        self._poller = asyncio.create_task(self._poll_health())

    async def stop(self, grace: float | None) -> None:
        """Reports NOT_SERVING, then stops; in-flight RPCs get ``grace`` seconds to finish, and those still running
        then end with UNAVAILABLE and the service's message (see :mod:`.calls`)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        await self._health.enter_graceful_shutdown()
        if self._inference is not None:
            self._inference.begin_drain()
        if grace is None:
            await self.server.stop(grace)
            return
        # grpc's own cancel comes later than ours: by then the calls have answered
        stopping = asyncio.create_task(self.server.stop(grace + GRPC_GRACE_MARGIN_S))
        done, _ = await asyncio.wait({stopping}, timeout=grace)
        if not done:
            self._calls.cut_off(cut_off_by_drain(grace))
        await stopping

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)

    async def _poll_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_SECONDS)
            await self._health.refresh()

    def __getattr__(self, name):
        return getattr(self.server, name)


def create_grpc_server(
    dataplane, host: str, port: int, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, reuse_port: bool = False,
    limits: GrpcLimits = GrpcLimits(),
) -> GRPCServer:
    """An unstarted gRPC server for ``dataplane``, bound to ``host:port``.

    Port 0 picks a free port; ``bound_port`` on the result is the port bound.
    ``max_message_bytes`` limits both received and sent messages (a request's raw
    tensors and a response's outputs travel in one message each); ``limits`` the calls in
    progress, connections and handshake time (see :mod:`.limits`). ``reuse_port`` lets
    sibling front-end processes listen on the same port; without it the port is this
    server's alone (grpc's default would let a second server join it: see
    :mod:`service.ports`). Call it from the event loop that will run the server.
    """
    server = aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", int(reuse_port)),
            *limits.options(),
        ],
        # past it a call is refused with RESOURCE_EXHAUSTED at once, rather than left for grpc-core to cancel
        # with a bare CANCELLED when the process falls behind (a flood of 4,000 calls: 884 such)
        maximum_concurrent_rpcs=limits.max_calls or None,
    )
    late_answers.install()
    inference = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    calls = CallTracker()
    servicer = InferenceServicer(dataplane, max_message_bytes=max_message_bytes)
    register(server, servicer, inference, calls)
    health = ReadinessHealthServicer(dataplane)
    register(server, health, health_pb2.DESCRIPTOR.services_by_name["Health"], calls)
    server.add_generic_rpc_handlers((UnservedMethods(inference),))

    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if port and not reuse_port:
        # grpc's own failure names no cause (it logs one); a plain bind first says why, in our words
        bind_listener(host, port, flag="--grpc-port").close()
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError:
        bound_port = 0
    if bound_port == 0:
        raise listen_error(f"{address} (--grpc-port)", None)
    return GRPCServer(server, bound_port, health, calls, servicer)
