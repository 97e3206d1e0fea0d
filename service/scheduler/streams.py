"""StreamStore: server-side h and c of stateful streams (Triton's sequence_id) for one model version.

A stream is one sequence sent in chunks. Its first chunk carries
``sequence_start`` (state starts at zeros), each chunk continues from the state the
previous one left, and ``sequence_end`` forgets it. Chunks of one stream run one at
a time, in arrival order (a FIFO lock per stream); chunks of different streams
batch together like any other requests, since a chunk is just a sequence with an
initial state.

Limits: at most ``max_streams`` live streams (one more is refused with
Unavailable); a stream without a chunk for ``idle_timeout_s`` is dropped with its state.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import NotFound, Unavailable
from ..metrics import ServerMetrics


@dataclass(eq=False)
class StreamState:
    """One live stream: its state rows (h [S, Ho], c [Sc, H] or None) and the lock ordering its chunks."""

    key: str
    h: np.ndarray | None = None
    c: np.ndarray | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: bool = False


class StreamStore:
    """Live streams of one model version."""

    def __init__(self, model: str, version: str, max_streams: int, idle_timeout_s: float,
                 metrics: ServerMetrics | None = None) -> None:
        self.model = model
        self.version = version
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self._metrics = metrics
        self._streams: dict[str, StreamState] = {}
        self._last_sweep = 0.0

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, key: str, start: bool) -> StreamState:
        """The stream ``key``: a fresh one when ``start`` (replacing any old one), else the live one."""
        now = time.monotonic()
        self._sweep(now)
        if start:
            if key not in self._streams and len(self._streams) >= self.max_streams:
                raise Unavailable(f"model '{self.model}' has {len(self._streams)} live streams (max_streams "
                                  f"{self.max_streams}); end finished streams with sequence_end or retry later")
            old = self._streams.get(key)
            if old is not None:
                old.ended = True
            state = StreamState(key)
            self._streams[key] = state
        else:
            state = self._streams.get(key)
            if state is None:
                raise NotFound(f"stream {key} of model '{self.model}' is not live (never started, ended, or idle "
                               f"longer than {self.idle_timeout_s:g}s); send its first chunk with sequence_start")
        state.last_used = now
        self._gauge()
        return state

    def close(self, state: StreamState) -> None:
        """Forget ``state`` (sequence_end, or a failed first chunk)."""
        state.ended = True
        if self._streams.get(state.key) is state:
            del self._streams[state.key]
        self._gauge()

    def clear(self) -> None:
        """Forget every stream (unload)."""
        for state in self._streams.values():
            state.ended = True
        self._streams.clear()
        self._gauge()

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < min(1.0, self.idle_timeout_s / 2):
            return
        self._last_sweep = now
        idle = [s for s in self._streams.values() if now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for state in idle:
            self.close(state)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.active_streams.labels(model=self.model, version=self.version).set(len(self._streams))
