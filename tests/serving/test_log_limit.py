"""ThrottledLog: client-caused warnings are logged at most once a period, with a count of the rest."""
from __future__ import annotations

import logging

from service.log_limit import ThrottledLog


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
