"""Triton's statistics extension (``/v2/models[/{m}[/versions/{v}]]/stats``, gRPC ``ModelStatistics``).

The numbers are read from the server's Prometheus series, so ``/stats`` and ``/metrics``
never disagree. Triton's fields and where each comes from, per model version:

- ``inference_count``: sequences computed (sum of ``rnnserve_batch_size``);
  ``execution_count``: engine calls (its count);
- ``success``: successful requests and their summed time from decoded to answered
  (``rnnserve_request_duration_seconds``); ``fail``: every other outcome of
  ``rnnserve_requests_total`` and the time of those that reached a scheduler;
- ``queue``: ``rnnserve_queue_duration_seconds``;
- ``compute_infer``: requests whose batch completed and their batches' engine time
  (``rnnserve_computed_requests_total``, ``rnnserve_request_compute_seconds_total``). The
  engine time includes the copies to and from the device, which rnnserve does not time
  apart, so ``compute_input`` and ``compute_output`` carry the same count with 0 ns;
- ``last_inference``: milliseconds since the epoch of the last success;
- ``cache_hit`` / ``cache_miss``: zero (there is no response cache); ``batch_stats`` is empty
  (batch sizes are in the ``rnnserve_batch_size`` histogram).

With several engine processes each reports its own and :func:`merge_statistics` adds them up.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..metrics import ServerMetrics

_NS = 1e9


def _values(metric: Any, model: str, version: str) -> dict[str, float]:
    """Sample name (plus ``:outcome`` for labelled outcomes) -> value, for one model version."""
    out: dict[str, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            labels = sample.labels
            if (labels.get("model") != model or labels.get("version") != version
                    or sample.name.endswith("_created")):  # a series' creation time, not a count
                continue
            key = sample.name + (f":{labels['outcome']}" if "outcome" in labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(round(seconds * _NS))}


def version_statistics(metrics: ServerMetrics, model: str, version: str) -> dict[str, Any]:
    """Triton's ``ModelStatistics`` of one served model version, as JSON (HTTP's form)."""
    requests = _values(metrics.requests, model, version)
    success = requests.get("rnnserve_requests_total:success", 0.0)
    failed = sum(v for k, v in requests.items() if not k.endswith(":success"))
    duration = _values(metrics.request_duration, model, version)
    queue = _values(metrics.queue_duration, model, version)
    batches = _values(metrics.batch_size, model, version)
    computed = _values(metrics.computed_requests, model, version).get("rnnserve_computed_requests_total", 0.0)
    compute_s = _values(metrics.request_compute, model, version).get("rnnserve_request_compute_seconds_total", 0.0)
    failed_s = _values(metrics.failed_request_duration, model, version).get(
        "rnnserve_failed_request_duration_seconds_total", 0.0)
    last = _values(metrics.last_inference, model, version).get("rnnserve_last_inference_timestamp_seconds", 0.0)
    return {
        "name": model,
        "version": version,
        "last_inference": int(last * 1000),
        "inference_count": int(batches.get("rnnserve_batch_size_sum", 0.0)),
        "execution_count": int(batches.get("rnnserve_batch_size_count", 0.0)),
        "inference_stats": {
            "success": _duration(success, duration.get("rnnserve_request_duration_seconds_sum", 0.0)),
            "fail": _duration(failed, failed_s),
            "queue": _duration(queue.get("rnnserve_queue_duration_seconds_count", 0.0),
                               queue.get("rnnserve_queue_duration_seconds_sum", 0.0)),
            "compute_input": _duration(computed, 0.0),
            "compute_infer": _duration(computed, compute_s),
            "compute_output": _duration(computed, 0.0),
            "cache_hit": _duration(0, 0.0),
            "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": [],
    }


def merge_statistics(reports: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One list of model statistics out of several engine processes' lists: counts and times add up,
    ``last_inference`` is the latest; versions keep the first list's order."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for report in reports:
        for stats in report:
            key = (stats["name"], stats["version"])
            seen = merged.get(key)
            if seen is None:
                merged[key] = _copy(stats)
                continue
            seen["last_inference"] = max(seen["last_inference"], stats["last_inference"])
            for field in ("inference_count", "execution_count"):
                seen[field] += stats[field]
            for kind, duration in stats["inference_stats"].items():
                total = seen["inference_stats"][kind]
                total["count"] += duration["count"]
                total["ns"] += duration["ns"]
    return list(merged.values())


def _copy(stats: dict[str, Any]) -> dict[str, Any]:
    out = dict(stats)
    out["inference_stats"] = {k: dict(v) for k, v in stats["inference_stats"].items()}
    out["batch_stats"] = list(stats["batch_stats"])
    return out
