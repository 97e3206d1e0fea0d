"""ThrottledLog: client-caused warnings are logged at most once a period, with a count of the rest."""
from __future__ import annotations

import contextlib
import logging

from service.log_limit import ThrottledLog, ThrottleFilter


@contextlib.contextmanager
def _filtered(name: str, prefixes: tuple[str, ...], caplog):
    """Logger ``name`` with a ThrottleFilter on ``prefixes`` (10 s), its warnings captured."""
    logger = logging.getLogger(name)
    throttle = ThrottleFilter(prefixes, period_s=10)
    logger.addFilter(throttle)
    try:
        with caplog.at_level(logging.WARNING, logger=name):
            yield logger
    finally:
        logger.removeFilter(throttle)


def test_a_throttled_warning_says_how_many_went_unlogged(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("service.log_limit.time.monotonic", lambda: clock[0])
    throttled = ThrottledLog(logging.getLogger("rnnserve.test"), period_s=10)
    with caplog.at_level(logging.WARNING, logger="rnnserve.test"):
        for step in range(25):  # one a second
            throttled.warning("restart %d", step)
            clock[0] += 1
    assert [r.getMessage() for r in caplog.records] == [
        "restart 0", "restart 10 (9 more like it in the last 10 s were not logged)",
        "restart 20 (9 more like it in the last 10 s were not logged)"]


def test_a_library_line_is_throttled_by_its_text_and_others_pass(caplog, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("service.log_limit.time.monotonic", lambda: clock[0])
    with _filtered("rnnserve.test.lib", ("Invalid HTTP request received.",), caplog) as logger:
        for _ in range(5):
            logger.warning("Invalid HTTP request received.")
            logger.warning("something else")
        clock[0] = 11.0
        logger.warning("Invalid HTTP request received.")
    assert [r.getMessage() for r in caplog.records] == (
        ["Invalid HTTP request received."] + ["something else"] * 5
        + ["Invalid HTTP request received. (4 more like it in the last 11 s were not logged)"])


def test_a_prefix_throttles_every_line_that_starts_with_it(caplog, monkeypatch):
    monkeypatch.setattr("service.log_limit.time.monotonic", lambda: 0.0)
    with _filtered("rnnserve.test.prefix", ("No supported WebSocket library detected",), caplog) as logger:
        for _ in range(3):
            logger.warning("No supported WebSocket library detected. Please use ...")
    assert len(caplog.records) == 1
