"""Prometheus metrics with vLLM's names, in a per-app registry.

Counters and gauges are read from the engine at scrape time (one source of truth); only the
latency histograms (time to first token, end-to-end, queue time, time per output token; vLLM's
names) and the aborted-request counter (``worker_requests_aborted_total``,
not a vLLM name) are observed by the HTTP layer. All carry the label ``model_name``.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.contracts import engine_metrics as metric
from worker.engines.base import Engine

# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# vLLM's buckets for the request-level latency histograms (seconds).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """Exposes an engine's counters and gauges under vLLM's metric names."""

    def __init__(self, engine: Engine, model_name: str, *, report_cache_size: bool = True,
                 reported_cache_blocks: int = 0) -> None:
        self._engine = engine
        self._model = model_name
        self._report_cache_size = report_cache_size
        self._reported_blocks = reported_cache_blocks

    def collect(self) -> Iterable[Metric]:
        s = self._engine.stats()
        labels = ["model_name"]
        values = [self._model]
        counters = (
            (metric.PREFIX_CACHE_QUERIES, "Prefix cache queries, tokens.", s.cache.queries_tokens),
            (metric.PREFIX_CACHE_HITS, "Prefix cache hits, in tokens.", s.cache.hit_tokens),
            ("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed.", s.generation_tokens),
            ("vllm:request_success", "Requests finished.", s.requests_finished),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        gauges = (
            (metric.RUNNING, "Requests running (holding KV blocks).", s.running),
            (metric.WAITING, "Requests waiting for admission.", s.waiting),
            (
                metric.KV_CACHE_USAGE,
                "KV cache usage, 0-1: fraction of blocks referenced by running requests.",
                s.cache.usage,
            ),
        )
        for name, doc, gvalue in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, gvalue)
            yield gauge
        if not self._report_cache_size:
            return
        # vLLM's info gauge: the cache geometry, so launchers and gateways learn the capacity.
        info = GaugeMetricFamily(
            metric.CACHE_CONFIG_INFO, "Information of the KV cache config.",
            labels=["block_size", "num_gpu_blocks"],
        )
        blocks = self._reported_blocks or s.cache.num_blocks
        info.add_metric([str(s.cache.block_size), str(blocks)], 1.0)
        yield info


class WorkerMetrics:
    """The per-app registry plus the TTFT histogram."""

    def __init__(self, engine: Engine, model_name: str, *, report_cache_size: bool = True,
                 reported_cache_blocks: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(
            engine, model_name, report_cache_size=report_cache_size,
            reported_cache_blocks=reported_cache_blocks,
        ))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, seconds (arrival to first generated token).",
            labelnames=["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._ttft_child = self._ttft.labels(model_name=model_name)
        self._aborted = Counter(
            "worker_requests_aborted",
            "Requests cancelled because their client went away, by where they were: "
            "waiting (queued for admission) or running (prefill or decode).",
            labelnames=["model_name", "stage"],
            registry=self.registry,
        )
        self._model = model_name
        small = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *REQUEST_LATENCY_BUCKETS)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency, seconds (arrival to last token).",
            labelnames=["model_name"], buckets=small, registry=self.registry,
        ).labels(model_name=model_name)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited for admission (a running slot and its KV blocks), seconds.",
            labelnames=["model_name"], buckets=(0.0005, *small), registry=self.registry,
        ).labels(model_name=model_name)
        self._tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token after the first (decode), seconds.",
            labelnames=["model_name"], buckets=TPOT_BUCKETS, registry=self.registry,
        ).labels(model_name=model_name)

    def observe_request(self, e2e_s: float, queue_s: float, tpot_s: float | None) -> None:
        """One finished prompt: its end-to-end latency, queue wait and time per output token
        (None with fewer than two output tokens)."""
        self._e2e.observe(e2e_s)
        self._queue.observe(queue_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)

    def count_abort(self, stage: str) -> None:
        self._aborted.labels(model_name=self._model, stage=stage).inc()

    def observe_ttft(self, seconds: float) -> None:
        self._ttft_child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
