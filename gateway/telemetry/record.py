"""The record of one request, filled in as it goes and turned into telemetry when it ends.

The proxy calls a handful of hooks (:meth:`RequestRecord.decided`, :meth:`upstream_headers`,
:meth:`upstream_done`, :meth:`first_byte`, :meth:`cache_reported`); the middleware calls
:meth:`Telemetry.finish` once the response is sent, which observes the metrics, classifies a
miss, writes the access log line and ends the spans. Never holds prompt text: hashes, counts,
ids and times only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from gateway.contracts.tracing import Tracing
from gateway.misses import MissTracker, Outcome
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.window import RecentWindow

if TYPE_CHECKING:
    from gateway.routing.types import Decision, PrefixMatcher, RouteRequest

ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


def _ns(perf: float, record: RequestRecord) -> int:
    """A perf_counter instant as epoch nanoseconds (span timestamps)."""
    return record.started_ns + int((perf - record.started) * 1e9)


@dataclass(eq=False)
class Telemetry:
    """One application's telemetry sinks."""

    metrics: GatewayMetrics
    tracing: Tracing = field(default_factory=Tracing.off)
    misses: MissTracker = field(default_factory=MissTracker)
    access_log: AccessLog = field(default_factory=AccessLog)
    window: RecentWindow = field(default_factory=RecentWindow)

    def finish(self, record: RequestRecord, status: int, sent_bytes: int) -> None:
        """The response went out (or the client left): account for the whole request, after
        what the proxy left until then (:meth:`RequestRecord.after_sent`)."""
        record.sent()
        now = time.perf_counter()
        latency = now - record.started
        record.status = status
        if record.error_code:
            self.metrics.errors.labels(str(status), record.error_code).inc()
        routed = record.path in ROUTED_PATHS and bool(record.worker)
        if routed:
            self.metrics.request_seconds.labels(record.policy, record.worker).observe(latency)
            if record.ttft_s is not None:
                self.metrics.ttft_seconds.labels(record.policy, record.worker).observe(
                    record.ttft_s)
            self._diagnose(record)
        if record.path in ROUTED_PATHS:
            self.window.add(
                time.time(), latency_s=latency, error=status >= 400, kind=record.kind,
                input_tokens=record.input_tokens or 0, cached_tokens=record.cached_tokens or 0,
                miss=bool(record.miss_cause),
            )
        self.access_log.write(record, latency, sent_bytes)
        if record.span is not None:
            record.end_span(status, now)

    def _diagnose(self, record: RequestRecord) -> None:
        if record.input_tokens is None or record.cached_tokens is None:
            return  # the worker reported nothing we can read
        outcome = Outcome(
            worker=record.worker, kind=record.kind, match_blocks=record.match_blocks,
            best_blocks=max(record.best_blocks, record.match_blocks),
            total_blocks=record.total_blocks, input_tokens=record.input_tokens,
            cached_tokens=record.cached_tokens,
            restarted=record.restarted
            or self.misses.restarted_since(record.worker, record.started),
            namespace_changed=record.namespace_changed, worker_evicting=record.worker_evicting,
        )
        self.metrics.predicted_tokens.labels(record.worker).inc(outcome.predicted_tokens())
        cause = self.misses.observe(outcome, record.request_id)
        if cause is not None:
            record.miss_cause = cause
            self.metrics.misses.labels(record.worker, cause).inc()


@dataclass(eq=False, slots=True)
class RequestRecord:
    """Everything telemetry needs about one request; filled in by hooks along the way."""

    telemetry: Telemetry
    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    started_ns: int = field(default_factory=time.time_ns)
    span: Span | None = None
    tenant: str = ""
    model: str = ""
    stream: bool = False
    policy: str = ""
    kind: str = ""
    reason: str = ""
    worker: str = ""
    match_blocks: int = 0
    best_blocks: int = 0
    total_blocks: int = 0
    worker_evicting: bool = False
    namespace_changed: bool = False
    restarted: bool = False
    attempts: int = 0
    input_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    status: int = 0
    error_code: str = ""
    miss_cause: str = ""
    _upstream_span: Span | None = None
    _upstream_started: float = 0.0
    _after_sent: list[Callable[[], None]] | None = None
    _soon: asyncio.Handle | None = None

    # -- hooks --------------------------------------------------------------------------------
    def parsed(
        self, *, tenant: str, model: str, stream: bool, text_hash: int, namespace: int
    ) -> None:
        """The request was validated: who asked, for what (``text_hash``: the prompt's head,
        0 when too short to tell; ``namespace``: the cache namespace seed)."""
        self.tenant, self.model, self.stream = tenant, model, stream
        self.namespace_changed = self.telemetry.misses.namespace_changed(text_hash, namespace)

    def decided(
        self, decision: Decision, request: RouteRequest, index: PrefixMatcher | None,
        started: float, ended: float | None = None,
    ) -> None:
        """A worker was chosen (from ``started`` to ``ended``, perf_counter instants; None:
        now). Call before the decision is recorded in the prefix index; ``index`` is what
        routing matched against (None for policies without one): whether the chosen worker's
        modelled cache is full is read from it. The deepest match any worker held comes with
        the decision (``Decision.known_blocks``)."""
        self.policy, self.reason = decision.policy, decision.reason
        self.kind = decision.label
        self.worker = decision.worker_id
        self.match_blocks = decision.match_blocks
        # In blocks, as the decision's depths (a long prompt has fewer checkpoints than blocks).
        self.total_blocks = request.key.total_blocks
        self.best_blocks = max(decision.known_blocks, decision.match_blocks)
        if index is not None:
            self.worker_evicting = index.tail_age(decision.worker_id) != float("inf")
        tracer = self.telemetry.tracing.tracer
        if tracer is not None and self.span is not None:
            span = tracer.start_span(
                "route", context=set_span_in_context(self.span),
                start_time=_ns(started, self), attributes={
                    "affinity.policy": decision.policy,
                    "affinity.decision.kind": self.kind,
                    "affinity.decision.reason": decision.reason,
                    "affinity.worker": decision.worker_id,
                    "affinity.predicted_match_blocks": decision.match_blocks,
                    "affinity.prefix.blocks": self.total_blocks,
                    "affinity.prefix.anchor": request.key.anchor_hex,
                })
            span.end(end_time=_ns(time.perf_counter() if ended is None else ended, self))

    def upstream_headers(self, headers: dict[str, str], worker: str = "") -> dict[str, str]:
        """An attempt at the chosen worker (``worker``; default: the decided one) starts: the
        headers to send it (the request id, and the trace context when tracing)."""
        self.attempts += 1
        self._upstream_started = time.perf_counter()
        out = {**headers, "x-request-id": self.request_id}
        tracer = self.telemetry.tracing.tracer
        if tracer is not None and self.span is not None:
            self._upstream_span = tracer.start_span(
                "upstream", context=set_span_in_context(self.span), kind=SpanKind.CLIENT,
                attributes={"affinity.worker": worker or self.worker,
                            "affinity.attempt": self.attempts})
            out.update(self.telemetry.tracing.headers_for(self._upstream_span))
        return out

    def upstream_done(self, status: int | None, error: str = "", at: float | None = None) -> None:
        """The attempt ended (at ``at``, a perf_counter instant; None: now): the whole reply
        was read (``status``) or it failed (``error``)."""
        if not self._upstream_started:
            return
        elapsed = (time.perf_counter() if at is None else at) - self._upstream_started
        self._upstream_started = 0.0
        self.telemetry.metrics.upstream_seconds.labels(self.policy, self.worker).observe(elapsed)
        span, self._upstream_span = self._upstream_span, None
        if span is not None:
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if error or (status is not None and (status == 429 or status >= 500)):
                span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
            span.end(end_time=None if at is None else _ns(at, self))

    def first_byte(self) -> None:
        """The first byte of a streamed answer went to the client."""
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started

    def cache_reported(self, input_tokens: int, cached_tokens: int, worker_started: str) -> None:
        """What the worker said it reused (``worker_started``: its start stamp, if it tells)."""
        self.input_tokens, self.cached_tokens = input_tokens, cached_tokens
        if self.telemetry.misses.worker_started(self.worker, worker_started):
            self.restarted = True

    def after_sent(self, work: Callable[[], None]) -> None:
        """``work`` (bookkeeping nothing in the answer depends on: reading the worker's report
        of it, settling its attempt) waits until the answer is handed to the client, off the
        client's time: :meth:`sent` runs it, in the order given, once, at the latest when
        :meth:`Telemetry.finish` accounts for the request."""
        if self._after_sent is None:
            self._after_sent = [work]
        else:
            self._after_sent.append(work)

    def sending(self) -> None:
        """The answer's last bytes are about to be written: what waits for them runs at the
        event loop's next pass at the latest, if the write must wait for a slow client (so a
        worker is not counted busy while a client reads); the caller calls :meth:`sent`
        right after the write, in the same pass when it did not wait, so that no other
        request is decided in between."""
        if self._after_sent is not None and self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self.sent)

    def sent(self) -> None:
        """The answer was handed to the client (or never will be): run what waited for it."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        waiting, self._after_sent = self._after_sent, None
        for work in waiting or ():
            work()

    # -- spans --------------------------------------------------------------------------------
    def end_span(self, status: int, now: float) -> None:
        span = self.span
        if span is None:
            return
        self.upstream_done(None, "the request ended before the worker's reply")
        attributes: dict[str, str | int] = {
            "http.response.status_code": status,
            "affinity.request_id": self.request_id,
            "affinity.attempts": self.attempts,
        }
        for key, value in (
            ("affinity.tenant_hash", self.tenant), ("gen_ai.request.model", self.model),
            ("affinity.policy", self.policy), ("affinity.decision.kind", self.kind),
            ("affinity.worker", self.worker), ("affinity.miss.cause", self.miss_cause),
            ("error.type", self.error_code),
        ):
            if value:
                attributes[key] = value
        if self.worker:
            attributes["affinity.predicted_match_blocks"] = self.match_blocks
        if self.cached_tokens is not None and self.input_tokens is not None:
            attributes["affinity.cached_tokens"] = self.cached_tokens
            attributes["affinity.input_tokens"] = self.input_tokens
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, self.error_code or f"HTTP {status}"))
        span.end(end_time=_ns(now, self))
        self.span = None
