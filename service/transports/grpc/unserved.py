"""Answers for methods of rnnserve's gRPC services that it does not serve.

grpc answers an unknown method with UNIMPLEMENTED "Method not found!". Triton's clients
call some methods rnnserve leaves out (shared memory, trace, logging settings): those get
UNIMPLEMENTED with what to use instead (:mod:`service.dataplane.unsupported`, the same words
as over REST), and any other method of the service the list of those it serves.
"""
from __future__ import annotations

import grpc

from ...dataplane.unsupported import GRPC_METHODS, unsupported
from ...errors import Unimplemented


class UnservedMethods(grpc.GenericRpcHandler):
    """A generic handler, added after the services' own: refuses their other methods with a message."""

    def __init__(self, service_descriptor) -> None:
        self._service = service_descriptor.full_name
        self._served = [m.name for m in service_descriptor.methods]

    def service(self, handler_call_details):
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        if service != self._service:
            return None  # grpc's own answer
        if method in GRPC_METHODS:
            error = unsupported(GRPC_METHODS[method], method)
        else:
            error = Unimplemented(f"{self._service} has no method '{method}'; rnnserve serves "
                                  f"{', '.join(self._served)}")

        async def refuse(_requests, context):
            # a stream handler: whatever kind of call it is, nothing is read before the answer
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, error.message)

        return grpc.stream_stream_rpc_method_handler(refuse)
