"""A minimal OTLP/HTTP trace receiver for tests: decodes what an exporter POSTs to /v1/traces.

It speaks the real wire format (protobuf ``ExportTraceServiceRequest``, optionally gzipped), so
a test sees exactly the spans a collector would receive.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import free_port, serve


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, object]


@dataclass
class OTLPReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    runner: web.AppRunner | None = None
    url: str = ""

    async def _traces(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        message = ExportTraceServiceRequest()
        message.ParseFromString(raw)
        self.requests += 1
        for resource_spans in message.resource_spans:
            service = ""
            for attr in resource_spans.resource.attributes:
                if attr.key == "service.name":
                    service = attr.value.string_value
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes: dict[str, object] = {}
                    for kv in span.attributes:
                        which = kv.value.WhichOneof("value")
                        attributes[kv.key] = getattr(kv.value, which) if which else None
                    self.spans.append(ReceivedSpan(
                        service=service, name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind, attributes=attributes,
                    ))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        port = free_port()
        self.runner = await serve(app, port)
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
