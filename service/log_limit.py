"""ThrottledLog: a warning that clients can cause, logged at most once a period.

A line a client can trigger with every request (a stream restarted under a live id) would
otherwise let one client fill the server's log and its disk. The first line is logged at
once; later ones within ``period_s`` are counted, and the next one logged says how many
went unlogged.
"""
from __future__ import annotations

import logging
import time


class ThrottledLog:
    """``warning`` on ``logger`` at most once every ``period_s`` seconds, counting the rest."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0) -> None:
        self.logger, self.period_s = logger, period_s
        self._last = float("-inf")
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        """Log ``message % args`` now, or count it when a line went out less than ``period_s`` ago."""
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like it in the last {now - self._last:.0f} s were not logged)"
        self._last, self._held = now, 0
        self.logger.warning(message, *args)
