"""Triton protocol extensions rnnserve does not serve, and what a client should do instead.

tritonclient has calls for Triton's shared-memory, trace and logging extensions, and some
tools call them on start. Without an answer of their own they would get a bare "Not Found"
(REST) or "Method not found!" (gRPC); both transports raise :func:`unsupported` instead, so
the client reads which extension is missing and what to use (501 / UNIMPLEMENTED). ``GET
/v2`` lists the extensions rnnserve serves.
"""
from __future__ import annotations

from ..errors import Unimplemented

_SHARED_MEMORY = ("send tensors in the request itself: the binary tensor extension over HTTP (what tritonclient.http "
                  "does by default) or raw_input_contents over gRPC")

# extension -> what to use instead
EXTENSIONS: dict[str, str] = {
    "system shared memory": _SHARED_MEMORY,
    "CUDA shared memory": _SHARED_MEMORY,
    "trace": "per-request timings are in the Prometheus metrics at GET /metrics (queue, compute and request "
             "duration histograms by model)",
    "logging": "set the log level when the server starts: --log-level (or RNNSERVE_LOG_LEVEL)",
    "generate": "recurrent models here take whole tensors: POST /v2/models/NAME/infer, or "
                "/v1/models/NAME:predict for ragged JSON sequences",
}

# gRPC method of Triton's GRPCInferenceService -> extension
GRPC_METHODS: dict[str, str] = {
    **{f"SystemSharedMemory{call}": "system shared memory" for call in ("Status", "Register", "Unregister")},
    **{f"CudaSharedMemory{call}": "CUDA shared memory" for call in ("Status", "Register", "Unregister")},
    "TraceSetting": "trace",
    "LogSettings": "logging",
}

# first segment of a REST path under /v2 -> extension (the trace one also sits under /v2/models/{m}/trace)
REST_PREFIXES: dict[str, str] = {
    "systemsharedmemory": "system shared memory",
    "cudasharedmemory": "CUDA shared memory",
    "trace": "trace",
    "logging": "logging",
}


def unsupported(extension: str, call: str) -> Unimplemented:
    """The error for ``call`` (a method or a path) of Triton's ``extension``, which rnnserve does not serve."""
    return Unimplemented(f"rnnserve does not implement Triton's {extension} extension ({call}); "
                         f"{EXTENSIONS[extension]}")
