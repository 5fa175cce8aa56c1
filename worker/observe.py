"""Per-request timings of the worker: latency histograms and the request's trace.

The HTTP layer notes when each prompt of a request arrived, was admitted (its blocks allocated:
the end of its queue wait), produced its first token (the end of prefill) and its last one.
From that come ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` and
``vllm:time_per_output_token_seconds``, and, when the caller sent a sampled W3C
``traceparent`` and tracing is on, a server span continuing the caller's trace with child spans
``queue``, ``prefill`` (cached and uncached prompt tokens) and ``decode``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from gateway.contracts.tracing import Tracing


@dataclass(slots=True)
class PromptTiming:
    """Loop-clock instants (seconds) of one prompt of a request."""

    arrived: float
    admitted: float = 0.0
    first_token: float = 0.0
    done: float = 0.0
    freed_at: float = 0.0  # time.monotonic() when its KV blocks went back to the cache
    computed_at: float = 0.0  # time.monotonic() at its first token: its blocks computed
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0


@dataclass(eq=False)
class RequestTrace:
    """The trace of one request, or nothing when tracing is off or the caller did not sample."""

    tracing: Tracing
    span: Span | None = None
    # epoch ns = loop seconds * 1e9 + offset
    _offset_ns: int = 0
    prompts: list[PromptTiming] = field(default_factory=list)

    @classmethod
    def start(
        cls, tracing: Tracing, headers: Mapping[str, str], name: str, loop_now: float,
        attributes: Mapping[str, str | int],
    ) -> RequestTrace:
        trace = cls(tracing, _offset_ns=time.time_ns() - int(loop_now * 1e9))
        tracer = tracing.tracer
        if tracer is not None:
            trace.span = tracer.start_span(
                name, context=tracing.extract(headers), kind=SpanKind.SERVER,
                start_time=trace.ns(loop_now), attributes=dict(attributes))
        return trace

    def ns(self, loop_time: float) -> int:
        return int(loop_time * 1e9) + self._offset_ns

    def prompt(self, arrived: float) -> PromptTiming:
        timing = PromptTiming(arrived)
        self.prompts.append(timing)
        return timing

    def finish(self, loop_now: float, status: int, error: str = "") -> None:
        span, self.span = self.span, None
        if span is None:
            return
        tracer = self.tracing.tracer
        assert tracer is not None
        parent = set_span_in_context(span)
        for i, p in enumerate(self.prompts):
            common = {"worker.prompt_index": i} if len(self.prompts) > 1 else {}
            phases: tuple[tuple[str, float, float, dict[str, int]], ...] = (
                ("queue", p.arrived, p.admitted, {}),
                ("prefill", p.admitted, p.first_token, {
                    "worker.cached_tokens": p.cached_tokens,
                    "worker.uncached_tokens": p.input_tokens - p.cached_tokens,
                }),
                ("decode", p.first_token, p.done, {"worker.output_tokens": p.output_tokens}),
            )
            for name, start, end, attributes in phases:
                if start and end >= start:
                    child = tracer.start_span(name, context=parent, start_time=self.ns(start),
                                              attributes={**common, **attributes})
                    child.end(end_time=self.ns(end))
        span.set_attribute("http.response.status_code", status)
        if self.prompts:
            span.set_attributes({
                "worker.input_tokens": sum(p.input_tokens for p in self.prompts),
                "worker.cached_tokens": sum(p.cached_tokens for p in self.prompts),
                "worker.output_tokens": sum(p.output_tokens for p in self.prompts),
            })
        if error or status >= 500:
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end(end_time=self.ns(loop_now))
