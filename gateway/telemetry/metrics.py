"""Prometheus metrics of one gateway process (a registry per application, no globals).

Names follow Prometheus conventions: seconds and tokens as base units, ``_total`` on counters
(added by the client library). Histograms are labelled by ``policy`` and ``worker`` (the worker
that answered; empty when the gateway answered itself).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.chat_histories import ChatHistories
from gateway.contracts.httpserver import ConnectionCap
from gateway.fingerprint_memo import FingerprintMemo
from gateway.kvevents.tokenize import PromptTokenizer
from gateway.limits import BodyBudget
from gateway.normal_texts import NormalTexts
from gateway.parse_pool import ParsePool
from gateway.pool import WorkerPool
from gateway.prompt_histories import PromptHistories
from gateway.telemetry.counters import LabelledCounter, LabelledHistogram
from gateway.telemetry.loop_lag import LAG_BUCKETS

# Seconds: from a few milliseconds (cache hits on a small model) to minutes (long generations).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0,
    60.0, 120.0, 300.0,
)


def build_version() -> str:
    try:
        return metadata.version("affinity-gateway")
    except metadata.PackageNotFoundError:
        return "unknown"


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
        modelled = GaugeMetricFamily(
            "gateway_worker_modelled_cache_blocks",
            "blocks the prefix index models the worker's prefix cache as holding",
            labels=["worker"])
        capacity = GaugeMetricFamily(
            "gateway_worker_cache_capacity_blocks",
            "the worker's prefix cache size in the gateway's blocks, as learnt from the worker "
            "(absent: unknown)", labels=["worker"])
        first_token = GaugeMetricFamily(
            "gateway_worker_engine_first_token_seconds",
            "mean time to first token the worker's engine reported for the requests it started "
            "between its last two scrapes (absent: it does not say); under quick_first_token_s "
            "cache_aware's hard load bound spares it", labels=["worker"])
        for state in self._pool.states():
            wid = [state.worker.id]
            healthy.add_metric(wid, 1.0 if state.healthy else 0.0)
            inflight.add_metric(wid, state.inflight_requests)
            tokens.add_metric(wid, state.inflight_tokens)
            inputs.add_metric(wid, state.input_tokens)
            matched.add_metric(wid, state.matched_tokens)
            modelled.add_metric(wid, self._pool.modelled_blocks(state.worker.id))
            if state.capacity_blocks:
                capacity.add_metric(wid, state.capacity_blocks)
            if state.first_token_s is not None:
                first_token.add_metric(wid, state.first_token_s)
        checkpoints = GaugeMetricFamily(
            "gateway_prefix_index_checkpoints",
            "checkpoints of prompts the prefix index knows some worker to hold")
        checkpoints.add_metric([], self._pool.index_checkpoints())
        yield from (healthy, inflight, tokens, inputs, matched, modelled, capacity, first_token,
                    checkpoints)


class _StateCollector(Collector):
    """Store health and build information, read at scrape time."""

    def __init__(self, store_up: Callable[[], bool], store_outages: Callable[[], int],
                 store_unreadable: Callable[[], int]) -> None:
        self._store_up = store_up
        self._store_outages = store_outages
        self._store_unreadable = store_unreadable

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gateway_store_up",
                               "1 while the metadata store answers, 0 during an outage")
        up.add_metric([], 1.0 if self._store_up() else 0.0)
        outages = CounterMetricFamily("gateway_store_outages",
                                      "times the metadata store became unreachable")
        outages.add_metric([], self._store_outages())
        unreadable = CounterMetricFamily(
            "gateway_store_unreadable_entries",
            "entries of the store's assignment stream this version could not read (skipped)")
        unreadable.add_metric([], self._store_unreadable())
        info = InfoMetricFamily("gateway_build", "version of the gateway and its Python")
        info.add_metric([], {"version": build_version(),
                             "python": platform.python_version()})
        yield from (up, outages, unreadable, info)


class MemoCollector(Collector):
    """What the gateway remembers of long prompts, read at scrape time: texts found normal
    (:mod:`gateway.normal_texts`), long chats (:mod:`gateway.chat_histories`) and long
    completions prompts (:mod:`gateway.prompt_histories`)."""

    def __init__(self, texts: NormalTexts, chats: ChatHistories, prompts: PromptHistories,
                 fingerprints: FingerprintMemo, parses: ParsePool | None = None,
                 responses: ChatHistories | None = None) -> None:
        self._texts = texts
        self._chats = chats
        self._responses = responses if responses is not None else ChatHistories(0)
        self._prompts = prompts
        self._fingerprints = fingerprints
        self._parses = parses

    def collect(self) -> Iterator[Metric]:
        texts, chats = self._texts, self._chats
        for family, name, help_text, value in (
            (CounterMetricFamily, "gateway_normal_text_hits",
             "long texts not checked again: found normal before", texts.hits),
            (CounterMetricFamily, "gateway_normal_text_prefix_hits",
             "long texts checked past the longest text found normal before that they begin "
             "with", texts.prefix_hits),
            (GaugeMetricFamily, "gateway_normal_text_rewritten_bytes",
             "bytes of long texts the rules rewrote, remembered as rewritten "
             "(--normal-text-bytes)", texts.held_bytes),
            (CounterMetricFamily, "gateway_chat_history_hits",
             "long chats decoded from their new messages on: joined to a remembered history",
             chats.hits),
            (GaugeMetricFamily, "gateway_chat_histories", "long chats remembered", len(chats)),
            (GaugeMetricFamily, "gateway_chat_history_bytes",
             "bytes of the bodies the remembered histories stand for (--chat-history-bytes)",
             chats.held_bytes),
            (CounterMetricFamily, "gateway_response_history_hits",
             "long Responses API requests decoded from their new input items on",
             self._responses.hits),
            (GaugeMetricFamily, "gateway_response_history_bytes",
             "bytes of the Responses bodies the remembered histories stand for "
             "(--chat-history-bytes)", self._responses.held_bytes),
            (CounterMetricFamily, "gateway_prompt_history_hits",
             "long completions prompts decoded from what they add on: joined to a remembered "
             "prompt", self._prompts.hits),
            (GaugeMetricFamily, "gateway_prompt_history_bytes",
             "bytes of the bodies the remembered prompts stand for (--chat-history-bytes)",
             self._prompts.held_bytes),
            (CounterMetricFamily, "gateway_fingerprint_prefix_hits",
             "long prompts hashed past the prompt before them (an agent's next turn)",
             self._fingerprints.hits),
            (GaugeMetricFamily, "gateway_fingerprint_memo_bytes",
             "bytes of the long prompt texts kept for their next turn's fingerprint "
             "(--chat-history-bytes)", self._fingerprints.held_bytes),
            (CounterMetricFamily, "gateway_thread_parses",
             "requests of very many items parsed on a thread, off the event loop "
             "(--parse-thread-items)", self._parses.parsed if self._parses is not None else 0),
        ):
            metric = family(name, help_text)
            metric.add_metric([], value)
            yield metric


# One unlabelled sample a family: (family class, name, help, value).
Scalar = tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]


def _scalars(rows: Iterable[Scalar]) -> Iterator[Metric]:
    for family, name, help_text, value in rows:
        metric = family(name, help_text)
        metric.add_metric([], value)
        yield metric


class ConnectionCollector(Collector):
    """Client connections against their cap (``--max-client-connections``), at scrape time."""

    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap

    def collect(self) -> Iterator[Metric]:
        cap = self._cap
        yield from _scalars((
            (GaugeMetricFamily, "gateway_client_connections",
             "client connections open (the loopback admin port's not counted)", cap.open),
            (GaugeMetricFamily, "gateway_client_connection_cap",
             "client connections the gateway keeps open at once (--max-client-connections)",
             cap.limit),
            (CounterMetricFamily, "gateway_refused_connections",
             "client connections answered 503 and closed: over the cap, every connection "
             "looked at busy with a request", cap.refused),
            (CounterMetricFamily, "gateway_evicted_connections",
             "client connections without a request in progress closed at the cap to make "
             "room for a new one", cap.evicted),
        ))


class BodyBudgetCollector(Collector):
    """Request body bytes held against the budget (``--max-held-body-bytes``), at scrape
    time."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterator[Metric]:
        budget = self._budget
        yield from _scalars((
            (GaugeMetricFamily, "gateway_held_body_bytes",
             "request body bytes held by requests being read or served", budget.held),
            (GaugeMetricFamily, "gateway_held_body_bytes_budget",
             "request body bytes the gateway holds at once (--max-held-body-bytes; 0: none)",
             budget.limit),
            (CounterMetricFamily, "gateway_body_budget_refusals",
             "requests refused with 429: their body did not fit the budget", budget.refused),
        ))


class TokenizerCollector(Collector):
    """Token-exact keying (``--tokenizer-file``), read at scrape time: how many prompts and
    tokens were keyed, and how much of that the prefix store saved from encoding again."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tokenizer = tokenizer

    def collect(self) -> Iterator[Metric]:
        stats, store = self._tokenizer.stats, self._tokenizer.prefixes
        prompts = CounterMetricFamily("gateway_tokenize_prompts",
                                      "prompts keyed by tokens (fallbacks to characters included)")
        prompts.add_metric([], stats.prompts)
        fallbacks = CounterMetricFamily("gateway_tokenize_fallbacks",
                                        "prompts that could not be tokenized (keyed by characters)")
        fallbacks.add_metric([], stats.fallbacks)
        tokens = CounterMetricFamily("gateway_tokenize_tokens", "tokens of the prompts keyed")
        tokens.add_metric([], stats.tokens)
        reused = CounterMetricFamily(
            "gateway_tokenize_reused_tokens",
            "of those, tokens taken from the prefix store instead of encoded again")
        reused.add_metric([], store.stats.reused_tokens)
        mismatches = CounterMetricFamily(
            "gateway_tokenize_prefix_mismatches",
            "cuts of the prefix store that failed their check (encoded from further back)")
        mismatches.add_metric([], store.stats.mismatches)
        segments = GaugeMetricFamily("gateway_tokenize_prefix_segments",
                                     "segments the prefix store holds")
        segments.add_metric([], len(store))
        yield from (prompts, fallbacks, tokens, reused, mismatches, segments)


class GatewayMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self._store_up: Callable[[], bool] = lambda: True
        self._store_outages: Callable[[], int] = lambda: 0
        self._store_unreadable: Callable[[], int] = lambda: 0
        self.registry = CollectorRegistry()
        registry = self.registry
        # The request path's metrics (gateway.telemetry.counters: no lock or validation per
        # update; the same samples as the client library's).
        self.requests = LabelledCounter(
            "gateway_requests", "requests routed, by policy and outcome",
            ["policy", "outcome"], registry=registry,
        )
        self.decisions = LabelledCounter(
            "gateway_route_decisions", "routing decisions by kind of reason",
            ["policy", "reason"], registry=registry,
        )
        self.retries = LabelledCounter(
            "gateway_retries", "requests re-routed after a worker failed before replying",
            ["worker"], registry=registry,
        )
        self.decision_seconds = LabelledHistogram(
            "gateway_route_decision_seconds", "time to fingerprint and route one request",
            registry=registry,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
        ).labels()
        self.request_seconds = LabelledHistogram(
            "gateway_request_duration_seconds",
            "end-to-end latency of completion requests, arrival to last byte sent",
            ["policy", "worker"], registry=registry, buckets=LATENCY_BUCKETS,
        )
        self.ttft_seconds = LabelledHistogram(
            "gateway_time_to_first_token_seconds",
            "streamed requests: arrival to the first byte of the answer relayed to the client",
            ["policy", "worker"], registry=registry, buckets=LATENCY_BUCKETS,
        )
        self.upstream_seconds = LabelledHistogram(
            "gateway_upstream_duration_seconds",
            "one attempt at a worker: request sent to last byte received (or failure)",
            ["policy", "worker"], registry=registry, buckets=LATENCY_BUCKETS,
        )
        self.errors = LabelledCounter(
            "gateway_errors", "error responses the gateway itself produced, by status and code",
            ["status", "code"], registry=registry,
        )
        self.predicted_tokens = LabelledCounter(
            "gateway_predicted_cached_tokens",
            "prompt tokens the prefix index predicted the chosen worker to hold",
            ["worker"], registry=registry,
        )
        self.misses = LabelledCounter(
            "gateway_cache_misses",
            "requests that reused less of the cache than was possible, by diagnosed cause",
            ["worker", "cause"], registry=registry,
        )
        self.loop_lag = LabelledHistogram(
            "gateway_event_loop_lag_seconds",
            "how late the event loop ran a timer sampled every 0.25 s (gateway.telemetry."
            "loop_lag): the wait every step of every request has before it runs",
            registry=registry, buckets=LAG_BUCKETS,
        ).labels()
        # The process's own CPU seconds, memory and file descriptors (process_*), as the
        # client library's default registry has them: the CPU per request is the gateway's cost.
        ProcessCollector(registry=registry)
        self.registry.register(_PoolCollector(pool))
        self.registry.register(
            _StateCollector(lambda: self._store_up(), lambda: self._store_outages(),
                            lambda: self._store_unreadable()))

    def watch_store(self, up: Callable[[], bool], outages: Callable[[], int],
                    unreadable: Callable[[], int] = lambda: 0) -> None:
        """Where ``gateway_store_up``, ``gateway_store_outages`` and
        ``gateway_store_unreadable_entries`` read from at scrape time."""
        self._store_up, self._store_outages, self._store_unreadable = up, outages, unreadable
