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
a batch's device time is the time from its start (the return of its launch, or the end of
the batch before it, whichever is later) to when its outputs were on the host, and the
clock keeps a moving average of that time per step of the batch's longest sequence.

When launching takes the host longer than the device takes to run a batch
(:meth:`DeviceClock.host_bound`: small models, short chunks), the next batch waits for
the running one to finish instead. On an H100 at concurrency 64, one batch in flight
gave batches of ~20 sequences and 10.9k requests/s against ~13 and 9.9k with two
(bench/results/h100-2026-11-22b/experiment_lanes_concurrency.log); with this rule the
batches hold ~20 again (serve_gpu.log). A
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
        self.device_s = 0.0  # predicted device time of the last launched batch
        self._last_done = 0.0
        self._last_returned = 0.0  # when the last launched batch's launch returned

    def launched(self, formed: float, returned: float, steps: int) -> None:
        """A batch of ``steps`` (longest sequence) was formed at ``formed`` and queued by ``returned``."""
        self.lead = _average(self.lead, returned - formed)
        start = max(returned, self.free_at)
        self.device_s = (self.per_step or 0.0) * steps
        self.free_at = start + self.device_s
        self._last_returned = returned

    def finished(self, returned: float, done: float, steps: int) -> None:
        """The batch whose launch returned at ``returned`` had its outputs on the host at ``done``.

        Batches finish in order; the device time counted is what is left after the launch returned
        (the device starts during the launch), which is what the next launch can overlap with.
        """
        seconds = done - max(returned, self._last_done)
        self._last_done = done
        if seconds > 0:
            self.per_step = _average(self.per_step, seconds / max(1, steps))
        if returned >= self._last_returned:
            # the last launched batch is done, so the device is free now: a prediction that ran long must not
            # carry over, or batches launched after it would queue behind a predicted end that never came
            self.free_at = done

    def form_at(self) -> float:
        """When to form the next batch so that it is launched as the device gets free."""
        return self.free_at - self.lead - MARGIN_S

    def host_bound(self) -> bool:
        """Whether launching a batch takes the host longer than the device takes to run one.

        Then a second batch launched behind the first would not start any sooner on the device
        than after the first is done, and forming it early only splits the waiting requests into
        more, smaller batches, each costing the host a whole launch.
        """
        return self.per_step is not None and self.lead >= self.device_s


def _average(old: float | None, new: float) -> float:
    return new if old is None or old == 0.0 else old + SMOOTHING * (new - old)
