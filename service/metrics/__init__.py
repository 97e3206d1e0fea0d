"""Prometheus metrics of rnnserve, created on a registry the composition root owns.

Nothing here touches prometheus_client's global registry, so two servers (or two
tests) in one process never share counters. Units follow Prometheus naming:
seconds, ``_total`` counters, histograms for durations and sizes. Every
per-model series carries ``model`` and ``version`` labels.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# From 50 µs: queue times and a GPU batch's compute are tens to hundreds of µs (buckets from 0.5 ms put every one
# in the first, and histogram_quantile read them all as 0.25-0.5 ms).
_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_STEP_BUCKETS = (1, 10, 25, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000)
_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
MV = ("model", "version")


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, in one bucket update.

    A message a front-end process merged answers ``count`` requests at once, each with the
    same duration; the engine process's one thread observed them one by one (5 % of it under
    binary-HTTP load on an H100 host). Falls back to the loop if prometheus_client's
    histogram internals ever change shape.
    """
    try:
        buckets, bounds, total = histogram._buckets, histogram._upper_bounds, histogram._sum
    except AttributeError:
        buckets = None
    if buckets is None or count == 1:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    for bucket, bound in zip(buckets, bounds):
        if value <= bound:
            bucket.inc(count)
            return


class ServerMetrics:
    """All series rnnserve exports; pass one instance to the dataplane, scheduler and registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.on_drop: list[Callable[[str, str], None]] = []  # called with (model, version) by drop_version
        r = self.registry
        self.requests = Counter(
            "rnnserve_requests",
            "Inference requests by outcome (success, cancelled: the client went away, or the error status, lower case); "
            "a body that does not decode into tensors (not JSON, a wrong datatype or size) is answered 400 and not counted.",
            MV + ("outcome",), registry=r)
        self.request_duration = Histogram(
            "rnnserve_request_duration_seconds", "Time from request decoded to response ready (successful requests).",
            MV, buckets=_LATENCY_BUCKETS, registry=r)
        self.failed_request_duration = Counter(
            "rnnserve_failed_request_duration_seconds", "Time from request decoded to error answered, summed over "
            "failed requests that reached a scheduler (refusals before it take no measurable time).", MV, registry=r)
        self.last_inference = Gauge(
            "rnnserve_last_inference_timestamp_seconds", "Unix time of the last successful request.", MV,
            registry=r)
        self.queue_duration = Histogram(
            "rnnserve_queue_duration_seconds", "Time a request waited in the scheduler before its batch ran.",
            MV, buckets=_LATENCY_BUCKETS, registry=r)
        self.compute_duration = Histogram(
            "rnnserve_compute_duration_seconds", "Engine time per batch, including merge and split.",
            MV, buckets=_LATENCY_BUCKETS, registry=r)
        self.computed_requests = Counter(
            "rnnserve_computed_requests", "Requests whose batch ran to completion.", MV, registry=r)
        self.request_compute = Counter(
            "rnnserve_request_compute_seconds", "Engine time of each request's batch, summed over those requests "
            "(divided by rnnserve_computed_requests_total: the mean compute time a request saw).", MV, registry=r)
        self.batch_size = Histogram(
            "rnnserve_batch_size", "Sequences per engine call.", MV, buckets=_BATCH_BUCKETS, registry=r)
        self.batch_timesteps = Histogram(
            "rnnserve_batch_timesteps", "Padded T (longest sequence) per engine call.", MV,
            buckets=_STEP_BUCKETS, registry=r)
        self.computed_timesteps = Counter(
            "rnnserve_computed_timesteps", "Sequence-steps the engine was given (batch size x padded T).", MV,
            registry=r)
        self.useful_timesteps = Counter(
            "rnnserve_useful_timesteps", "Sequence-steps that were real data (sum of lengths); "
            "1 - useful/computed is the padding waste.", MV, registry=r)
        self.batch_failures = Counter(
            "rnnserve_batch_failures", "Engine calls that raised; their requests failed.", MV, registry=r)
        self.queue_depth = Gauge(
            "rnnserve_queue_depth", "Requests waiting in the scheduler (with --frontends N, the engine "
            "process's: requests a front-end holds back while its messages are out are "
            "rnnserve_frontend_queue_depth).", MV, registry=r)
        self.frontend_queue_depth = Gauge(
            "rnnserve_frontend_queue_depth", "Requests waiting in the front-end processes (with --frontends N) for "
            "their front-end's messages to the engine process to come back, as last reported (every 0.25 s); "
            "add rnnserve_queue_depth for every request waiting.", MV, registry=r)
        self.active_streams = Gauge(
            "rnnserve_active_streams", "Live stateful streams (sequence_id) holding state on the server.", MV,
            registry=r)
        self.stream_starts = Counter(
            "rnnserve_stream_starts", "Stateful streams started (a chunk with sequence_start).", MV, registry=r)
        self.stream_ends = Counter(
            "rnnserve_stream_ends", "Stateful streams ended, by reason: end (sequence_end), error (their first "
            "chunk failed, or a chunk's client went away before its answer: cancelled, disconnected, or its gRPC "
            "stream ended before the answer was delivered), unload (the model was unloaded or reloaded), restart (a second sequence_start while "
            "live).", MV + ("reason",), registry=r)
        self.stream_expirations = Counter(
            "rnnserve_stream_expirations", "Stateful streams dropped after stream_idle_timeout_s without a chunk.",
            MV, registry=r)
        self.stream_chunk_timesteps = Histogram(
            "rnnserve_stream_chunk_timesteps", "Time steps per chunk of a stateful stream.", MV,
            buckets=_STEP_BUCKETS, registry=r)
        self.model_load_duration = Histogram(
            "rnnserve_model_load_duration_seconds", "Time to read a model and build its engine.", MV,
            buckets=_LOAD_BUCKETS, registry=r)
        self.model_ready = Gauge(
            "rnnserve_model_ready", "1 when the model version serves requests, else 0.", MV, registry=r)
        self.model_engine = Gauge(
            "rnnserve_model_engine", "1 for the engine serving a model version (label engine).",
            MV + ("engine",), registry=r)
        self.device_memory = Gauge(
            "rnnserve_device_memory_bytes", "Accelerator memory in use by rnnserve (0 on CPU).", ("device",),
            registry=r)

        # the GPU's own counters (NVML), as Triton's nv_gpu_* series: absent without a GPU or NVML
        self.gpu_utilization = Gauge(
            "rnnserve_gpu_utilization_ratio", "Share of the driver's last sample period in which a kernel of any "
            "process ran on the GPU, 0 to 1 (NVML).", ("device",), registry=r)
        self.gpu_memory_used = Gauge(
            "rnnserve_gpu_memory_used_bytes", "GPU memory in use by every process (NVML).", ("device",), registry=r)
        self.gpu_memory_total = Gauge(
            "rnnserve_gpu_memory_total_bytes", "GPU memory (NVML).", ("device",), registry=r)
        self.gpu_power = Gauge("rnnserve_gpu_power_watts", "Power the GPU draws (NVML).", ("device",), registry=r)

    def watch_device_memory(self, device: str, read: Callable[[], float]) -> None:
        """Report ``read()`` as device memory in use on ``device`` at every scrape."""
        self.device_memory.labels(device=device).set_function(read)

    def watch_gpu(self, device: str, gpu: Any) -> None:
        """Report ``gpu``'s readings (a :class:`service.engines.cudnn.nvml.GpuCounters`) at every scrape."""
        for gauge, read in ((self.gpu_utilization, gpu.utilization), (self.gpu_memory_used, gpu.memory_used),
                            (self.gpu_memory_total, gpu.memory_total), (self.gpu_power, gpu.power_watts)):
            gauge.labels(device=device).set_function(read)

    def forget_model(self, model: str, version: str) -> None:
        """Mark an unloaded version not ready and drop its other gauges (counters and histograms keep their
        history).

        ``rnnserve_model_ready`` stays, at 0: an alert on ``rnnserve_model_ready == 0`` must see a version
        that was unloaded, and a series that vanished reads as "no data", not as 0 (the registry removes it once
        the version leaves the index). Queue depth
        and live streams of a version that no longer serves say nothing, so they go.
        """
        self.model_ready.labels(model=model, version=version).set(0)
        for gauge in (self.queue_depth, self.frontend_queue_depth, self.active_streams):
            with contextlib.suppress(KeyError):  # never set for this version
                gauge.remove(model, version)

    def drop_version(self, model: str, version: str) -> None:
        """Remove every series of ``model``/``version``: the version left the repository index (its folder was
        deleted, the version policy moved past it, the model went). Counters and histograms of such versions stayed
        until a restart, so ``/metrics`` grew by ~100 series a rollout (6,710 series of one model after 50).
        ``on_drop`` callbacks let holders of bound series (the dataplane's cache) let go of theirs."""
        for metric in self._per_model():
            for labels in {tuple(sample.labels.get(n, "") for n in metric._labelnames)  # noqa: SLF001
                           for family in metric.collect() for sample in family.samples
                           if sample.labels.get("model") == model and sample.labels.get("version") == version}:
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)
        for callback in self.on_drop:
            callback(model, version)

    def _per_model(self) -> list:
        return [m for m in vars(self).values()
                if isinstance(m, (Counter, Gauge, Histogram)) and tuple(m._labelnames[:2]) == MV]  # noqa: SLF001

    def render(self) -> bytes:
        """Prometheus text exposition of every series."""
        return generate_latest(self.registry)


__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]
