"""Prometheus metrics with vLLM's names, in a per-app registry.

Counters and gauges are read from the engine at scrape time (one source of truth); only the
latency histograms (time to first token, end-to-end, queue time, time per output token; vLLM's
names) and the aborted-request counter (``worker_requests_aborted_total``,
not a vLLM name) are observed by the HTTP layer. All carry the label ``model_name``.

With data-parallel ranks (``--data-parallel-size`` above 1) every engine series also carries
vLLM's label ``engine="<rank>"``: one sample per rank of each gauge and counter, and the HTTP
layer observes each request's latencies through its rank's :class:`RankMetrics`. With one
engine there is no ``engine`` label, as with vLLM without data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.contracts import engine_metrics as metric
from worker.engines.base import Engine, EngineStats

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


_Read = Callable[[EngineStats], float]

_COUNTERS: tuple[tuple[str, str, _Read], ...] = (
    (metric.PREFIX_CACHE_QUERIES, "Prefix cache queries, tokens.",
     lambda s: s.cache.queries_tokens),
    (metric.PREFIX_CACHE_HITS, "Prefix cache hits, in tokens.", lambda s: s.cache.hit_tokens),
    ("vllm:prompt_tokens", "Prefill tokens processed.", lambda s: s.prompt_tokens),
    ("vllm:generation_tokens", "Generation tokens processed.", lambda s: s.generation_tokens),
    ("vllm:request_success", "Requests finished.", lambda s: s.requests_finished),
)
_GAUGES: tuple[tuple[str, str, _Read], ...] = (
    (metric.RUNNING, "Requests running (holding KV blocks).", lambda s: s.running),
    (metric.WAITING, "Requests waiting for admission.", lambda s: s.waiting),
    (
        metric.KV_CACHE_USAGE,
        "KV cache usage, 0-1: fraction of blocks referenced by running requests.",
        lambda s: s.cache.usage,
    ),
)


class EngineCollector:
    """Exposes the engines' counters and gauges under vLLM's metric names: one sample per
    engine, labelled ``engine="<rank>"`` when there are several."""

    def __init__(self, engines: Sequence[Engine], model_name: str, *,
                 report_cache_size: bool = True, reported_cache_blocks: int = 0) -> None:
        self._engines = tuple(engines)
        self._model = model_name
        self._report_cache_size = report_cache_size
        self._reported_blocks = reported_cache_blocks
        self._ranked = len(self._engines) > 1

    def _labels(self, *names: str) -> list[str]:
        return [*names, "engine"] if self._ranked else list(names)

    def _values(self, rank: int, *values: str) -> list[str]:
        return [*values, str(rank)] if self._ranked else list(values)

    def collect(self) -> Iterable[Metric]:
        snapshots = [engine.stats() for engine in self._engines]
        labels = self._labels("model_name")
        for name, doc, read in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=labels)
            for rank, s in enumerate(snapshots):
                counter.add_metric(self._values(rank, self._model), read(s))
            yield counter
        for name, doc, read in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for rank, s in enumerate(snapshots):
                gauge.add_metric(self._values(rank, self._model), read(s))
            yield gauge
        if self._report_cache_size:
            yield self._cache_config(snapshots)

    def _cache_config(self, snapshots: Sequence[EngineStats]) -> Metric:
        """vLLM's info gauge: the cache geometry, so launchers and gateways learn the
        capacity."""
        info = GaugeMetricFamily(
            metric.CACHE_CONFIG_INFO, "Information of the KV cache config.",
            labels=self._labels("block_size", "num_gpu_blocks"),
        )
        for rank, s in enumerate(snapshots):
            blocks = self._reported_blocks or s.cache.num_blocks
            info.add_metric(self._values(rank, str(s.cache.block_size), str(blocks)), 1.0)
        return info


class RankMetrics:
    """What the HTTP layer observes of the requests one engine (rank) ran: latencies and
    aborts, under that rank's labels."""

    def __init__(self, ttft: Histogram, e2e: Histogram, queue: Histogram, tpot: Histogram,
                 aborted: Counter, labels: Mapping[str, str]) -> None:
        self._ttft = ttft.labels(**labels)
        self._e2e = e2e.labels(**labels)
        self._queue = queue.labels(**labels)
        self._tpot = tpot.labels(**labels)
        self._aborted = aborted
        self._labels = dict(labels)

    def observe_request(self, e2e_s: float, queue_s: float, tpot_s: float | None) -> None:
        """One finished prompt: its end-to-end latency, queue wait and time per output token
        (None with fewer than two output tokens)."""
        self._e2e.observe(e2e_s)
        self._queue.observe(queue_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)

    def count_abort(self, stage: str) -> None:
        self._aborted.labels(**self._labels, stage=stage).inc()

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)


class WorkerMetrics:
    """The per-app registry: the engines' collector plus the latency histograms and abort
    counter, observed per rank (:meth:`rank`)."""

    def __init__(self, engines: Sequence[Engine], model_name: str, *,
                 report_cache_size: bool = True, reported_cache_blocks: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(
            engines, model_name, report_cache_size=report_cache_size,
            reported_cache_blocks=reported_cache_blocks,
        ))
        ranked = len(engines) > 1
        names = ["model_name", "engine"] if ranked else ["model_name"]
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, seconds (arrival to first generated token).",
            labelnames=names, buckets=TTFT_BUCKETS, registry=self.registry,
        )
        aborted = Counter(
            "worker_requests_aborted",
            "Requests cancelled because their client went away, by where they were: "
            "waiting (queued for admission) or running (prefill or decode).",
            labelnames=[*names, "stage"], registry=self.registry,
        )
        small = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *REQUEST_LATENCY_BUCKETS)
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency, seconds (arrival to last token).",
            labelnames=names, buckets=small, registry=self.registry,
        )
        queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited for admission (a running slot and its KV blocks), seconds.",
            labelnames=names, buckets=(0.0005, *small), registry=self.registry,
        )
        tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token after the first (decode), seconds.",
            labelnames=names, buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self._ranks = tuple(
            RankMetrics(ttft, e2e, queue, tpot, aborted,
                        {"model_name": model_name, "engine": str(r)} if ranked
                        else {"model_name": model_name})
            for r in range(len(engines))
        )

    def rank(self, rank: int) -> RankMetrics:
        """The observations of requests run by engine ``rank``."""
        return self._ranks[rank]

    def render(self) -> bytes:
        return generate_latest(self.registry)
