"""grpc.aio's error record for an answer sent after the call ended is dropped; its other errors are kept.

The record is the one grpc 1.8x's ``_handle_exceptions`` writes (``aio/server.pyx.pxi``) when a client's
deadline passes as the servicer answers: logger ``grpc._cython.cygrpc``, ERROR, with a traceback. The race
that produces it is a few in thousands of deadlines, too rare to provoke in a test, so the record is
written here as grpc writes it, through a logger a real ``create_grpc_server`` has set up.
"""
from __future__ import annotations

import asyncio
import logging

import pytest

from service.transports.grpc import create_grpc_server
from service.transports.grpc.late_answers import GRPC_LOGGER

METHOD = "/inference.GRPCInferenceService/ModelInfer"


class ExecuteBatchError(Exception):
    """Stands in for grpc's own (cygrpc.ExecuteBatchError, not importable from Python)."""


@pytest.fixture(scope="module", autouse=True)
def built_server():
    async def build():
        server = create_grpc_server(object(), "127.0.0.1", 0)
        await server.server.stop(None)

    asyncio.run(build())


def _log_as_grpc_does(message: str, *args: str) -> None:
    try:
        raise ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')
    except ExecuteBatchError:
        logging.getLogger(GRPC_LOGGER).exception(message, *args)


def test_a_late_answer_is_a_debug_line_not_an_error(caplog):
    caplog.set_level(logging.DEBUG)
    _log_as_grpc_does("ExecuteBatchError raised in core by servicer method [%s]", METHOD)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    notes = [r for r in caplog.records if r.name == "rnnserve.grpc"]
    assert len(notes) == 1 and notes[0].levelno == logging.DEBUG
    assert METHOD in notes[0].getMessage() and "call had ended" in notes[0].getMessage()


def test_grpc_s_other_errors_still_reach_the_log(caplog):
    caplog.set_level(logging.DEBUG)
    _log_as_grpc_does("Unexpected [%s] raised by servicer method [%s]", "ValueError", METHOD)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == GRPC_LOGGER]
    assert len(errors) == 1 and errors[0].exc_info is not None
