"""gateway.telemetry.counters: the same exposition as the client library's metrics."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.telemetry.counters import LabelledCounter, LabelledHistogram
from gateway.telemetry.metrics import LATENCY_BUCKETS

_OBSERVED = (0.001, 0.005, 0.0051, 0.3, 1.0, 400.0, 0.1, 0.0)


def _page(fast: bool) -> str:
    registry = CollectorRegistry()
    counter_type = LabelledCounter if fast else Counter
    histogram_type = LabelledHistogram if fast else Histogram
    counter = counter_type("t_requests", "requests", ["policy", "outcome"], registry=registry)
    latency = histogram_type("t_seconds", "latency", ["policy", "worker"], registry=registry,
                             buckets=LATENCY_BUCKETS)
    plain = histogram_type("t_decision_seconds", "decisions", registry=registry,
                           buckets=(1e-5, 2.5e-5, 1e-2))
    counter_type("t_unused", "never counted", ["worker"], registry=registry)
    counter.labels("cache_aware", "200").inc()
    counter.labels("cache_aware", "200").inc(3)
    counter.labels("round_robin", "unavailable").inc()
    for value in _OBSERVED:
        latency.labels("cache_aware", "w1").observe(value)
    latency.labels("cache_aware", "w2").observe(0.02)
    decisions = plain.labels() if isinstance(plain, LabelledHistogram) else plain
    for value in (2e-5, 1e-5, 5.0):
        decisions.observe(value)
    # Creation times differ between the two runs; everything else must not.
    return re.sub(r"(_created(?:\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


def test_same_samples_as_the_client_library() -> None:
    ours, theirs = _page(fast=True), _page(fast=False)
    assert 't_seconds_bucket{le="0.005",policy="cache_aware",worker="w1"} 3.0' in ours
    assert ours == theirs


def test_histogram_buckets_are_cumulative_with_inf() -> None:
    histogram = LabelledHistogram("h", "doc", ["a"], buckets=(1.0, 2.0))
    child = histogram.labels("x")
    for value in (0.5, 1.0, 1.5, 3.0, math.nan):
        child.observe(value)
    samples = {(s.name, s.labels.get("le")): s.value
               for metric in histogram.collect() for s in metric.samples}
    assert samples[("h_bucket", "1.0")] == 2
    assert samples[("h_bucket", "2.0")] == 3
    assert samples[("h_bucket", "+Inf")] == 4  # NaN lands in no bucket
    assert samples[("h_count", None)] == 4


def test_counter_refuses_a_negative_amount_and_wrong_label_count() -> None:
    counter = LabelledCounter("c", "doc", ["a", "b"])
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("x", "y").inc(-1)
    with pytest.raises(ValueError, match="2 label values expected"):
        counter.labels("x")
