"""grpc.aio's error log for an answer sent to a call that had already ended, turned into one debug line.

When a client's deadline passes (or it disconnects) just as the servicer returns its answer, grpc
core has ended the call before grpc.aio knows the client left, and sending the answer fails.
grpc.aio then logs ``ExecuteBatchError raised in core by servicer method [...]`` at ERROR with a
traceback (``_handle_exceptions`` in grpc's ``aio/server.pyx.pxi``; once it has seen the client
leave it says nothing). The client has its DEADLINE_EXCEEDED or CANCELLED either way and nothing in
the server is wrong, but under many client deadlines the log filled with tracebacks that read like
crashes. The record is dropped and the service's own logger notes it at debug level instead.
"""
from __future__ import annotations

import logging

GRPC_LOGGER = "grpc._cython.cygrpc"
# grpc.aio's message for a batch of operations (the answer) that core refused to send
LATE_ANSWER_PREFIX = "ExecuteBatchError raised in core by servicer method"

log = logging.getLogger("rnnserve.grpc")


class LateAnswerFilter(logging.Filter):
    """Drops grpc.aio's late-answer error record, noting it at debug level on ``rnnserve.grpc``."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if not message.startswith(LATE_ANSWER_PREFIX):
            return True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("an answer to %s was not sent: the call had ended first (client deadline or disconnect)",
                      _method(record))
        return False


def _method(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()[len(LATE_ANSWER_PREFIX):].strip() or "a gRPC call"
    except (TypeError, ValueError):
        return "a gRPC call"


_FILTER = LateAnswerFilter()


def install() -> None:
    """Adds the filter to grpc's logger once (idempotent: every server built in a process shares it)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
