"""OpenTelemetry tracing, shared by the gateway and the reference worker.

Off unless an OTLP endpoint is configured: then :attr:`Tracing.tracer` is ``None`` and the
request path checks that one attribute and does nothing else. On, each application owns its
own ``TracerProvider`` (no global provider, so two applications in one process never mix their
spans), samples root traces at a ratio (a sampled parent is always followed), and exports in
batches over OTLP/HTTP (protobuf) or OTLP/gRPC. W3C ``traceparent``/``tracestate`` headers carry
the context in and out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PROTOCOLS = ("http", "grpc")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


@dataclass(frozen=True, slots=True)
class TracingOptions:
    endpoint: str = ""  # "" = tracing off
    protocol: str = "http"
    sample_ratio: float = 1.0
    service_name: str = "affinity-gateway"

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"otel protocol must be one of {', '.join(PROTOCOLS)}, "
                             f"got {self.protocol!r}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"otel sample ratio must be in [0, 1], got {self.sample_ratio}")


def http_traces_url(endpoint: str) -> str:
    """OTLP/HTTP wants the full traces URL; a bare base URL gets the standard ``/v1/traces``."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def _exporter(options: TracingOptions) -> SpanExporter:
    if options.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        target = options.endpoint
        insecure = not target.startswith("https://")
        target = target.removeprefix("http://").removeprefix("https://")
        return GrpcExporter(endpoint=target, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=http_traces_url(options.endpoint))


class Tracing:
    """An application's tracer, or nothing at all when tracing is off."""

    def __init__(self, provider: TracerProvider | None, name: str = "affinity-gateway") -> None:
        self._provider = provider
        self._propagator = TraceContextTextMapPropagator()
        self.tracer: Tracer | None = provider.get_tracer(name) if provider is not None else None

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    @classmethod
    def build(cls, options: TracingOptions, exporter: SpanExporter | None = None) -> Tracing:
        """A tracer exporting to ``options.endpoint``, or to ``exporter`` when given (each
        span as it ends: for tests with the SDK's in-memory exporter); off when neither."""
        if exporter is None and not options.endpoint:
            return cls.off()
        provider = TracerProvider(
            resource=Resource.create({"service.name": options.service_name}),
            sampler=ParentBased(TraceIdRatioBased(options.sample_ratio)),
        )
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            provider.add_span_processor(BatchSpanProcessor(_exporter(options)))
        return cls(provider, options.service_name)

    def extract(self, headers: Mapping[str, str]) -> Context:
        """The caller's trace context from W3C headers (an empty context when none)."""
        carrier = {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if k in headers}
        return self._propagator.extract(carrier)

    def headers_for(self, span: Span) -> dict[str, str]:
        """W3C headers that make ``span`` the parent of the next hop."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier

    async def shutdown(self) -> None:
        """Flush what is queued and stop exporting (blocking work, off the event loop)."""
        if self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)
