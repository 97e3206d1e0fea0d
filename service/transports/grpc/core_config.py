"""grpc core settings that must be in place before ``grpc`` is first imported.

grpc reads ``GRPC_EXPERIMENTS`` once, when its C core loads. Its default I/O path
(the EventEngine listener and client endpoints) hands every read and write to the
EventEngine's own threads, one more thread hand-off per event than the classic
poller, in which the thread that polls the completion queue also does the I/O.
Switching those two experiments off halved the time of a grpc.aio call answering
canned bytes at concurrency 1 (0.23-0.25 ms instead of 0.47-0.52 on H100 hosts,
``bench/transport_floor.py``, both ends on this setting) and cut the server's CPU per
unary call from ~230 to ~190 µs (2-core VM). A grpc that no longer knows these
experiments logs "Unknown experiment" once and runs its defaults. A
``GRPC_EXPERIMENTS`` the user set, even empty (grpc's defaults), is left as it is.
"""
from __future__ import annotations

import os

# The experiments switched off when GRPC_EXPERIMENTS is unset.
DEFAULT_EXPERIMENTS = "-event_engine_listener,-event_engine_client"


def apply_defaults() -> None:
    """Sets ``GRPC_EXPERIMENTS`` to :data:`DEFAULT_EXPERIMENTS` unless it is set.

    Takes effect only where ``grpc`` is not imported yet; spawned front-end
    processes inherit it.
    """
    os.environ.setdefault("GRPC_EXPERIMENTS", DEFAULT_EXPERIMENTS)


apply_defaults()
