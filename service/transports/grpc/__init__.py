"""The gRPC transport: Open Inference Protocol (KServe V2) GRPCInferenceService.

Thin: wire messages <-> protocol types, then the one DataPlane. The .proto is in
``proto/``; the generated code in ``generated/`` (see ``generated/regenerate.sh``).
"""
from . import core_config  # noqa: F401  (first: grpc reads its settings when first imported)
from .server import GRPCServer, create_grpc_server

__all__ = ["GRPCServer", "create_grpc_server"]
