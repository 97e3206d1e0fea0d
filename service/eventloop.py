"""Which asyncio event loop the server runs on: uvloop when installed, else the standard one.

uvloop (what ``uvicorn[standard]`` uses) halves the event loop's own cost per request;
every request crosses the loop several times (socket read, scheduler queue, worker
thread hand-off, response write), so it shows directly in latency and requests/s.
``--event-loop asyncio`` keeps the standard loop (e.g. to compare, or to debug).

:func:`watch_stalls` logs when something held a process's event loop for longer than
:data:`STALL_S` (every request the process holds waits that long), and at ``--log-level debug``
from :data:`NOTE_S` on: shorter holds are what a p99 of a few milliseconds is made of (256 paced
streams on some H100 hosts had chunks over 10 ms inside the server with no 20 ms stall logged).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, Literal, TypeVar

from .errors import InvalidInput

T = TypeVar("T")
EventLoopName = Literal["auto", "uvloop", "asyncio"]
log = logging.getLogger("rnnserve.eventloop")

STALL_S = 0.020
NOTE_S = 0.005  # logged at debug level from here
_TICK_S = 0.050


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


async def watch_stalls(threshold_s: float = STALL_S) -> None:
    """Run forever: log each time the loop came back to a timer ``threshold_s`` or more late."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + _TICK_S
        await asyncio.sleep(_TICK_S)
        late = loop.time() - due
        if late >= threshold_s:
            log.warning("this process's event loop was blocked for about %.0f ms", 1e3 * late)
        elif late >= NOTE_S and log.isEnabledFor(logging.DEBUG):
            log.debug("this process's event loop was blocked for about %.0f ms", 1e3 * late)


_watchers: set[asyncio.Task] = set()


def start_stall_watch() -> None:
    """Start :func:`watch_stalls` in the running loop (once it serves: loading models may block it)."""
    task = asyncio.get_running_loop().create_task(watch_stalls(), name="stall-watch")
    _watchers.add(task)
    task.add_done_callback(_watchers.discard)
