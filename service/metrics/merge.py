"""One Prometheus exposition out of several engine processes' (``rnnserve serve --engines N``).

Each engine process counts what it served in its own registry; a scrape of any
front-end must still show one series per model, as with one engine process, so
the front-end adds the processes' samples up: counters, histogram buckets, sums and
counts, queue depths, live streams and device memory add. Two kinds of gauge state
something every process holds for itself and take the smallest value instead: a
model is ready (``rnnserve_model_ready`` 1) only when it is ready in every process,
and a series was created (``*_created``) when the first process created it. The last
inference (``rnnserve_last_inference_timestamp_seconds``) is the latest of any process, and the GPU's own
counters (``rnnserve_gpu_*``), which every process reads from the one GPU, are taken once (the largest).
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_SMALLEST = frozenset({"rnnserve_model_ready", "rnnserve_model_engine"})
_LARGEST = frozenset({"rnnserve_last_inference_timestamp_seconds", "rnnserve_gpu_utilization_ratio",
                      "rnnserve_gpu_memory_used_bytes", "rnnserve_gpu_memory_total_bytes", "rnnserve_gpu_power_watts"})


class _Merged:
    """A collector yielding already merged families (what generate_latest renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_expositions(texts: list[bytes]) -> bytes:
    """The exposition of the series of every text in ``texts``, samples of one series combined."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            smallest = family.name in _SMALLEST or family.name.endswith("_created")
            largest = family.name in _LARGEST
            series = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen = series.get(key)
                if seen is None:
                    series[key] = sample.value
                else:
                    series[key] = (min(seen, sample.value) if smallest else max(seen, sample.value) if largest
                                   else seen + sample.value)
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)
