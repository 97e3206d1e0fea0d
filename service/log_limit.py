"""Throttled warnings: lines that clients can cause, logged at most once a period.

A line a client can trigger with every request (a stream restarted under a live id, a request
the HTTP parser cannot read) would otherwise let one client fill the server's log and its
disk. The first line is logged at once; later ones within ``period_s`` are counted, and the
next one logged says how many went unlogged.
"""
from __future__ import annotations

import logging
import time


class _Throttle:
    """Whether a line may go out now, and how many were held back since the last one that did."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last = float("-inf")
        self._held = 0

    def suffix(self) -> str | None:
        """None to hold this line back; else what to append to it ("" when nothing was held back)."""
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._held += 1
            return None
        note = f" ({self._held} more like it in the last {now - self._last:.0f} s were not logged)" if self._held else ""
        self._last, self._held = now, 0
        return note


class ThrottledLog:
    """``warning`` on ``logger`` at most once every ``period_s`` seconds, counting the rest."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0) -> None:
        self.logger = logger
        self._throttle = _Throttle(period_s)

    def warning(self, message: str, *args: object) -> None:
        """Log ``message % args`` now, or count it when a line went out less than ``period_s`` ago."""
        suffix = self._throttle.suffix()
        if suffix is not None:
            self.logger.warning(message + suffix, *args)


class ThrottleFilter(logging.Filter):
    """A filter letting the lines that start with each of ``prefixes`` (another library's lines, by their text)
    through at most once every ``period_s`` seconds, the one let through counting those held back."""

    def __init__(self, prefixes: tuple[str, ...], period_s: float = 10.0) -> None:
        super().__init__()
        self._throttles = {prefix: _Throttle(period_s) for prefix in prefixes}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg if isinstance(record.msg, str) else ""
        throttle = next((t for prefix, t in self._throttles.items() if text.startswith(prefix)), None)
        if throttle is None:
            return True
        suffix = throttle.suffix()
        if suffix:
            record.msg += suffix
        return suffix is not None
