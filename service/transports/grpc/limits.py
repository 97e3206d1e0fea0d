"""GrpcLimits: what one server process's gRPC side may hold at once.

grpc-core buffers a call's request message until its last byte arrives, before any handler
runs, and grpc's Python API has no memory quota and no time limit on that; HTTP/2 flow control
does not help either, since the transport opens a stream's window to the size its message
declares (measured: 20 calls each sending half of a 60 MiB message grew a server by 600 MB,
with BDP probing off and a 64 KiB lookahead as with grpc's defaults). What partial messages can
hold is therefore at most calls in progress x ``--max-request-bytes``. A default low enough to
keep that under the host's memory (188 calls on a 24 GiB host) refused ordinary clients (200
concurrent calls, 200 open streams, health watches), so the default stays high and the start-up
log states the worst case; behind untrusted clients, lower ``--max-request-bytes`` or
``--max-grpc-calls``. Set here:

- calls in progress (``--max-grpc-calls``, default 4,096): one more is refused with
  RESOURCE_EXHAUSTED at once;
- connections (``--max-grpc-connections``; 0: an eighth of the open-file limit), checked by
  grpc-core before any handshake, so that connections cannot take every descriptor;
- the time a new connection may take to send HTTP/2's preface (the server's ``--body-timeout-s``,
  as for an HTTP request's head; grpc's own is 120 s), and the time one may stay open with no
  call (:data:`IDLE_S`: it is then sent GOAWAY and closed; clients reconnect on their next call);
- calls one connection may hold open (:data:`MAX_STREAMS_PER_CONNECTION`).
"""
from __future__ import annotations

import resource
from dataclasses import dataclass


MAX_STREAMS_PER_CONNECTION = 1024
IDLE_S = 300.0  # a connection with no call for this long is closed (abandoned ones held descriptors for good)


def auto_connection_cap() -> int:
    """An eighth of this process's open-file limit (HTTP takes three quarters; the rest is for the engine
    sockets, shared memory and model files); 0 when the limit is unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else max(16, soft // 8)


@dataclass(frozen=True)
class GrpcLimits:
    """One process's gRPC limits; 0 in any field: none (grpc's own default)."""

    max_calls: int = 0
    max_connections: int = 0
    handshake_timeout_s: float = 0.0
    idle_s: float = IDLE_S

    @classmethod
    def of(cls, max_calls: int, max_connections: int, handshake_timeout_s: float) -> "GrpcLimits":
        """The limits from the server's settings, with the automatic connection cap for 0."""
        return cls(max_calls, max_connections or auto_connection_cap(), handshake_timeout_s)

    def options(self) -> list[tuple[str, int]]:
        """grpc-core channel arguments for these limits (``max_calls`` is the server's own argument)."""
        options = [("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                   ("grpc.max_connection_idle_ms", max(1, round(self.idle_s * 1000)))]
        if self.max_connections:
            options.append(("grpc.max_allowed_incoming_connections", self.max_connections))
        if self.handshake_timeout_s:
            options.append(("grpc.server_handshake_timeout_ms", max(1, round(self.handshake_timeout_s * 1000))))
        return options

    def describe(self, max_message_bytes: int) -> str:
        """One line for the start-up log, with what partial messages could hold at worst."""
        def count(n: int) -> str:
            return f"{n:,}" if n else "no limit"
        worst = f"{self.max_calls * max_message_bytes / 2**30:,.0f} GiB" if self.max_calls else "no bound"
        return (f"gRPC limits: {count(self.max_calls)} calls in progress, {count(self.max_connections)} connections; "
                f"partial messages of up to {max_message_bytes / 2**20:,.0f} MiB each could hold {worst} "
                f"(behind untrusted clients lower --max-request-bytes or --max-grpc-calls)")
