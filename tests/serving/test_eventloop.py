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
