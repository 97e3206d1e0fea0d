"""GrpcLimits: what one server process's gRPC side may hold at once.

grpc-core buffers a call's request message until the last byte arrives, before any handler
runs, and grpc's Python API has no memory quota and no time limit on that. HTTP/2 flow control
does not help either: the transport opens each stream's window to the size the message
declares (measured: 20 calls each sending half of a 60 MiB message grew a server by 600 MB,
with grpc's BDP probing off and a 64 KiB lookahead just as with its defaults). So what a
process holds in partial messages is bounded by how many calls it takes at once times
``--max-request-bytes``, and that count is what is set here:

- calls in progress (``--max-grpc-calls``; 0 picks as many as half this host's memory, or the
  container's limit, holds at ``--max-request-bytes`` each, split between the front-end
  processes, from 64 to 4,096). One more is refused with RESOURCE_EXHAUSTED at once;
- connections (``--max-grpc-connections``; 0: an eighth of the open-file limit), checked by
  grpc-core before any handshake, so that idle connections cannot take every descriptor;
- the time a new connection may take to send HTTP/2's preface and settings (the server's
  ``--body-timeout-s``, as for an HTTP request's head); grpc's own is 120 s;
- calls one connection may hold open (:data:`MAX_STREAMS_PER_CONNECTION`).
"""
from __future__ import annotations

import resource
from dataclasses import dataclass

from ...host_memory import host_memory_bytes

MAX_STREAMS_PER_CONNECTION = 1024
MIN_AUTO_CALLS, MAX_AUTO_CALLS = 64, 4096


def auto_call_cap(max_message_bytes: int, processes: int, memory_bytes: int | None = None) -> int:
    """Calls in progress per process so that their messages, each at most ``max_message_bytes``, fill at most
    half of ``memory_bytes`` (this host's, or its container's) across ``processes`` gRPC processes; kept within
    64..4,096 (below 64 a burst of ordinary clients would be refused)."""
    memory = host_memory_bytes() if memory_bytes is None else memory_bytes
    fits = memory // 2 // (max(1, max_message_bytes) * max(1, processes))
    return max(MIN_AUTO_CALLS, min(MAX_AUTO_CALLS, fits))


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

    @classmethod
    def of(cls, max_calls: int, max_connections: int, handshake_timeout_s: float, max_message_bytes: int,
           processes: int) -> "GrpcLimits":
        """The limits from the server's settings, with the automatic values for the ones given as 0."""
        return cls(max_calls or auto_call_cap(max_message_bytes, processes),
                   max_connections or auto_connection_cap(), handshake_timeout_s)

    def options(self) -> list[tuple[str, int]]:
        """grpc-core channel arguments for these limits (``max_calls`` is the server's own argument)."""
        options = [("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)]
        if self.max_connections:
            options.append(("grpc.max_allowed_incoming_connections", self.max_connections))
        if self.handshake_timeout_s:
            options.append(("grpc.server_handshake_timeout_ms", max(1, round(self.handshake_timeout_s * 1000))))
        return options

    def describe(self) -> str:
        """One phrase for the start-up log."""
        def count(n: int) -> str:
            return f"{n:,}" if n else "no limit"
        return f"gRPC limits: {count(self.max_calls)} calls in progress, {count(self.max_connections)} connections"
