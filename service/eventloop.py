"""Which asyncio event loop the server runs on: uvloop when installed, else the standard one.

uvloop (what ``uvicorn[standard]`` uses) halves the event loop's own cost per request;
every request crosses the loop several times (socket read, scheduler queue, worker
thread hand-off, response write), so it shows directly in latency and requests/s.
``--event-loop asyncio`` keeps the standard loop (e.g. to compare, or to debug).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, Literal, TypeVar

from .errors import InvalidInput

T = TypeVar("T")
EventLoopName = Literal["auto", "uvloop", "asyncio"]
log = logging.getLogger("rnnserve.eventloop")


def loop_factory(name: EventLoopName) -> Any:
    """The loop factory for ``name`` (None: asyncio's default); 'uvloop' without uvloop is an error."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise InvalidInput("--event-loop uvloop needs the uvloop package: pip install uvloop "
                               "(or use --event-loop auto)") from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], name: EventLoopName = "auto") -> T:
    """``asyncio.run(main)`` on the chosen event loop."""
    try:
        factory = loop_factory(name)
    except InvalidInput:
        main.close()  # never awaited: close it, so Python does not warn about it
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        log.debug("event loop: %s", "uvloop" if factory is not None else "asyncio")
        return runner.run(main)
