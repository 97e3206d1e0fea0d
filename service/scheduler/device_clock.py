"""When will the device be free? Just-in-time batch forming for engines that queue batches.

An engine that ``launches`` (the cuDNN engine) runs batches in order on one CUDA stream,
and a recurrent batch's device time is set by its longest sequence (one step after the
other), hardly by how many sequences it holds: on an H100, an LSTM with H=128 takes
about as long for 12 sequences of 200 steps as for 1. Launching the next batch the
moment the last one started (what ``concurrent_batches = 2`` did alone) therefore
queued many small batches behind each other on the stream: at concurrency 64 the
batches held ~12 sequences, and the requests that arrived while a batch waited on the
stream could not join it.

:class:`DeviceClock` predicts when the batches in flight will be done and the scheduler
forms the next batch only shortly before that (``lead``: how long merging and launching
a batch take on the host), so it holds everything that arrived meanwhile, and the
device still never waits for it. The prediction is learned from the batches themselves:
a batch's device time is the time from its start (its launch, or the end of the batch
before it, whichever is later) to when its outputs were on the host, and the clock
keeps a moving average of that time per step of the batch's longest sequence. A
prediction that is too long costs a short idle gap (the next batch forms when the last
one is done, as with one batch in flight); one that is too short launches early, as
before. The clock sees only its own model's batches: other models on the same device
make it predict early, never hold a batch for longer than its own model's work.
"""
from __future__ import annotations

SMOOTHING = 0.2  # weight of the newest batch in the moving averages
MARGIN_S = 100e-6  # form the next batch this much earlier than strictly needed (event wake-up, jitter)


class DeviceClock:
    """Predicted end of the device work queued by one scheduler (``time.perf_counter()`` seconds)."""

    def __init__(self) -> None:
        self.per_step: float | None = None  # device seconds per step of a batch's longest sequence
        self.lead = 0.0  # host seconds from forming a batch to its launch returning
        self.free_at = 0.0  # predicted end of the last launched batch
        self._last_done = 0.0

    def launched(self, formed: float, returned: float, steps: int) -> None:
        """A batch of ``steps`` (longest sequence) was formed at ``formed`` and queued by ``returned``."""
        self.lead = _average(self.lead, returned - formed)
        start = max(formed, self.free_at)
        self.free_at = start + (self.per_step or 0.0) * steps

    def finished(self, formed: float, done: float, steps: int) -> None:
        """The batch formed at ``formed`` had its outputs on the host at ``done`` (batches finish in order)."""
        seconds = done - max(formed, self._last_done)
        self._last_done = done
        if seconds > 0:
            self.per_step = _average(self.per_step, seconds / max(1, steps))

    def form_at(self) -> float:
        """When to form the next batch so that it is launched as the device gets free."""
        return self.free_at - self.lead - MARGIN_S


def _average(old: float | None, new: float) -> float:
    return new if old is None or old == 0.0 else old + SMOOTHING * (new - old)
