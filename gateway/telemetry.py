"""Prometheus metrics of one gateway process (a registry per application, no globals)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.pool import WorkerPool


def reason_kind(reason: str) -> str:
    """Collapse a decision reason into a low-cardinality label."""
    for kind in ("prefix_hit", "cold", "diverted", "ring", "round_robin", "least_load"):
        if reason.startswith(kind):
            return kind
    return "other"


class _PoolCollector(Collector):
    """Reads per-worker state at scrape time, so the hot path updates nothing twice."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("gateway_worker_healthy", "1 if the worker is routable",
                                    labels=["worker"])
        inflight = GaugeMetricFamily("gateway_worker_inflight_requests",
                                     "requests in flight to the worker", labels=["worker"])
        tokens = GaugeMetricFamily("gateway_worker_inflight_tokens",
                                   "estimated tokens in flight to the worker", labels=["worker"])
        inputs = CounterMetricFamily("gateway_worker_input_tokens",
                                     "prompt tokens the worker reported", labels=["worker"])
        matched = CounterMetricFamily("gateway_worker_matched_tokens",
                                      "prompt tokens the worker served from its prefix cache",
                                      labels=["worker"])
        for state in self._pool.states():
            wid = [state.worker.id]
            healthy.add_metric(wid, 1.0 if state.healthy else 0.0)
            inflight.add_metric(wid, state.inflight_requests)
            tokens.add_metric(wid, state.inflight_tokens)
            inputs.add_metric(wid, state.input_tokens)
            matched.add_metric(wid, state.matched_tokens)
        yield from (healthy, inflight, tokens, inputs, matched)


class GatewayMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gateway_requests", "requests routed, by policy and outcome",
            ["policy", "outcome"], registry=self.registry,
        )
        self.decisions = Counter(
            "gateway_route_decisions", "routing decisions by kind of reason",
            ["policy", "reason"], registry=self.registry,
        )
        self.retries = Counter(
            "gateway_retries", "requests re-routed after a worker failed before replying",
            ["worker"], registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "gateway_route_decision_seconds", "time to fingerprint and route one request",
            registry=self.registry,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
        )
        self.registry.register(_PoolCollector(pool))
