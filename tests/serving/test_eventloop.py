"""The event loop choice: uvloop when installed, the standard loop on request, a clear error otherwise."""
from __future__ import annotations

import asyncio
import sys

import pytest

from service import eventloop
from service.errors import InvalidInput


async def _loop_type() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop")
    assert eventloop.run(_loop_type(), "auto").startswith("uvloop")


def test_asyncio_runs_on_the_standard_loop() -> None:
    assert eventloop.run(_loop_type(), "asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert eventloop.run(_loop_type(), "auto").startswith("asyncio")
    with pytest.raises(InvalidInput, match="pip install uvloop"):
        eventloop.run(_loop_type(), "uvloop")


@pytest.mark.asyncio
async def test_a_blocked_event_loop_is_logged(caplog):
    import asyncio
    import time

    from service import eventloop

    with caplog.at_level("WARNING", logger="rnnserve.eventloop"):
        watch = asyncio.create_task(eventloop.watch_stalls(0.03))
        await asyncio.sleep(0.01)
        time.sleep(0.12)  # holds the loop
        await asyncio.sleep(0.1)
        watch.cancel()
    assert any("event loop was blocked for about" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_shorter_holds_are_logged_at_debug_level_only(caplog, monkeypatch):
    import time

    monkeypatch.setattr(eventloop, "NOTE_S", 0.002)
    for level, expected in (("INFO", []), ("DEBUG", ["DEBUG"])):
        caplog.clear()
        with caplog.at_level(level, logger="rnnserve.eventloop"):
            watch = asyncio.create_task(eventloop.watch_stalls(10.0))  # no hold is a warning
            await asyncio.sleep(0.01)
            time.sleep(0.12)  # holds the loop
            await asyncio.sleep(0.1)
            watch.cancel()
        levels = [r.levelname for r in caplog.records if "event loop was blocked for about" in r.getMessage()]
        assert levels[:1] == expected
