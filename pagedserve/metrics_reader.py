"""`LLM.get_metrics()`: the engine's vllm:* metrics as plain values, under the types vLLM's offline API gives
(vllm.v1.metrics.reader), read from the Prometheus registry the offline engine records into.

Gauges give their value, counters theirs as an int (under the name without `_total`, as Prometheus' own API
names them), a counter with a `position` label one Vector of its counts by position (speculative decoding's
accepted tokens per draft position), and a histogram its count, sum and cumulative bucket counts keyed by the
bucket's `le` as it is exported ("0.5", "+Inf").
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector", "get_metrics_snapshot"]


@dataclass
class Metric:
    """One metric series: its name and labels (a name may have several series, one per set of labels)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """A counter per position, in order (position i at values[i]; positions never counted are 0)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # le -> observations at or below it


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every vllm:* series in `registry`, in the registry's order."""
    snapshot: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            snapshot += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name.endswith("_total")]
            if any("position" in s.labels for s in totals):
                snapshot += _vectors(family.name, totals)
            else:
                snapshot += [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
        elif family.type == "histogram":
            snapshot += _histograms(family.name, family.samples)
    return snapshot


def _without(labels: dict[str, str], name: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != name))


def _vectors(name: str, samples: list) -> list[Metric]:
    by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_without(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    return [Vector(name, dict(labels), [counts.get(i, 0) for i in range(max(counts) + 1)])
            for labels, counts in by_labels.items()]


def _histograms(name: str, samples: list) -> list[Metric]:
    parts: dict[tuple[tuple[str, str], ...], dict] = {}
    for s in samples:
        part = parts.setdefault(_without(s.labels, "le"), {"count": 0, "sum": 0.0, "buckets": {}})
        if s.name.endswith("_bucket"):
            part["buckets"][s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            part["count"] = int(s.value)
        elif s.name.endswith("_sum"):
            part["sum"] = float(s.value)
    return [Histogram(name, dict(labels), p["count"], p["sum"], p["buckets"]) for labels, p in parts.items()]
