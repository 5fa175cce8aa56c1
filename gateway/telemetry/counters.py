"""Labelled counters and histograms for the request path, exposed through a registry.

The client library's ``Counter`` and ``Histogram`` convert and validate label values on every
``labels()`` call, check observability and take a lock on every ``inc()``/``observe()`` (twice
for a histogram), and find a histogram's bucket with a Python loop. A gateway request updates
several of them, all from the event loop's thread. These keep one child per label values with
plain fields (an ``inc`` is one addition; an ``observe`` an addition and a binary search) and
expose exactly the samples the library's metrics do: ``_total`` and ``_created`` for a counter;
``_bucket`` (cumulative, ``le`` as the library writes it), ``_count``, ``_sum`` and
``_created`` for a histogram. Not thread-safe: update them from the event loop only.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# How the client library writes a bucket's ``le`` (Go's float formatting).
_le = cast(Callable[[float], str], floatToGoString)


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose upper bound is at least ``amount``."""
        self.sum += amount
        bounds = self._bounds  # the last is +Inf: every number has a bucket
        i = bisect.bisect_left(bounds, amount)
        if amount <= bounds[i]:  # NaN lands in no bucket, as with the client library
            self.counts[i] += 1


class _Labelled(Collector):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry | None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        if registry is not None:
            registry.register(self)

    def _labels(self, values: Sequence[str]) -> dict[str, str]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
        return dict(zip(self.labelnames, values, strict=True))


class LabelledCounter(_Labelled):
    """A counter family: ``labels(*values)`` is the child for those values (made once)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self._children: dict[tuple[str, ...], CounterChild] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            self._labels(values)
            child = self._children[values] = CounterChild()
        return child

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "counter")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        for values, child in list(self._children.items()):
            labels = self._labels(values)
            metric.add_sample(self.name + "_total", labels, child.value)
            metric.add_sample(self.name + "_created", labels, child.created)
        return [metric]


class LabelledHistogram(_Labelled):
    """A histogram family with fixed buckets (``+Inf`` is added): ``labels(*values)`` is the
    child for those values (made once)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None,
                 buckets: Sequence[float] = ()) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        self._les = tuple(_le(b) for b in bounds)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            self._labels(values)
            child = self._children[values] = HistogramChild(self.bounds)
        return child

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        for values, child in list(self._children.items()):
            labels = self._labels(values)
            total = 0
            for le, count in zip(self._les, child.counts, strict=True):
                total += count
                metric.add_sample(self.name + "_bucket", {**labels, "le": le}, total)
            metric.add_sample(self.name + "_count", labels, total)
            metric.add_sample(self.name + "_sum", labels, child.sum)
            metric.add_sample(self.name + "_created", labels, child.created)
        return [metric]
