"""OpenTelemetry traces: gateway spans (server, route, upstream), the W3C context passed on to
the worker (which continues the trace) and to SageMaker (custom attributes), sampling, and the
real OTLP/HTTP export decoded by a receiver on 127.0.0.1."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.telemetry.middleware import TELEMETRY_KEY
from tests.conftest import FAST_WORKER, MODEL, StartCluster
from tests.otlp_receiver import OTLPReceiver

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PREFIX = "Summarise the maintenance log of the pumping station and flag anomalies. " * 20


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


def hex_span(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def parent_of(span: ReadableSpan) -> str:
    return f"{span.parent.span_id:016x}" if span.parent is not None else ""


async def post(url: str, body: dict[str, object], headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_tracing_is_off_by_default() -> None:
    app = create_app(GatewaySettings(worker=("http://127.0.0.1:9",)))
    assert app[TELEMETRY_KEY].tracing.tracer is None


async def test_gateway_and_worker_spans_form_one_trace(start_cluster: StartCluster) -> None:
    gateway_spans, worker_spans = InMemorySpanExporter(), InMemorySpanExporter()
    cluster = await start_cluster(workers=2, span_exporter=gateway_spans,
                                  worker_span_exporter=worker_spans)
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    body = {"model": MODEL, "prompt": PREFIX + "week 12", "max_tokens": 3}
    assert await post(cluster.gateway_url + "/v1/completions", body,
                      {"traceparent": traceparent, "Authorization": "Bearer k"}) == 200
    body["prompt"] = PREFIX + "week 13"
    assert await post(cluster.gateway_url + "/v1/completions", body,
                      {"Authorization": "Bearer k"}) == 200
    spans = gateway_spans.get_finished_spans()
    servers = by_name(spans, "POST /v1/completions")
    assert len(servers) == 2
    first, second = servers
    # The first continues the client's trace; the second starts its own.
    assert hex_trace(first) == CLIENT_TRACE
    assert parent_of(first) == CLIENT_SPAN
    assert first.kind == SpanKind.SERVER
    assert hex_trace(second) != CLIENT_TRACE
    assert second.parent is None
    attrs = dict(first.attributes or {})
    assert attrs["affinity.policy"] == "cache_aware"
    assert attrs["affinity.decision.kind"] == "cold"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["http.response.status_code"] == 200
    assert attrs["affinity.attempts"] == 1
    assert attrs["affinity.cached_tokens"] == 0
    assert int(str(attrs["affinity.input_tokens"])) > 0
    assert len(str(attrs["affinity.tenant_hash"])) == 16
    second_attrs = dict(second.attributes or {})
    assert second_attrs["affinity.decision.kind"] == "prefix_hit"
    assert int(str(second_attrs["affinity.predicted_match_blocks"])) > 0
    assert int(str(second_attrs["affinity.cached_tokens"])) > 0
    for server in servers:
        children = [s for s in spans if parent_of(s) == hex_span(server)]
        assert sorted(s.name for s in children) == ["route", "upstream"]
    upstream = next(s for s in by_name(spans, "upstream") if parent_of(s) == hex_span(first))
    assert upstream.kind == SpanKind.CLIENT
    assert dict(upstream.attributes or {})["http.response.status_code"] == 200
    # The worker continued the trace under the gateway's upstream span.
    wspans = worker_spans.get_finished_spans()
    wserver = [s for s in wspans if s.kind == SpanKind.SERVER and hex_trace(s) == CLIENT_TRACE]
    assert len(wserver) == 1
    assert parent_of(wserver[0]) == hex_span(upstream)
    phases = {s.name: s for s in wspans if parent_of(s) == hex_span(wserver[0])}
    assert sorted(phases) == ["decode", "prefill", "queue"]
    prefill = dict(phases["prefill"].attributes or {})
    assert prefill["worker.cached_tokens"] == 0
    assert int(str(prefill["worker.uncached_tokens"])) > 0
    assert dict(phases["decode"].attributes or {})["worker.output_tokens"] == 3
    assert "PUMPING" not in str([s.to_json() for s in spans + wspans]).upper()


async def test_sampling_ratio_zero_still_follows_a_sampled_caller(
    start_cluster: StartCluster,
) -> None:
    spans = InMemorySpanExporter()
    cluster = await start_cluster(workers=1, span_exporter=spans, otel_sample_ratio=0.0)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    assert await post(cluster.gateway_url + "/v1/completions", body, {}) == 200
    assert spans.get_finished_spans() == ()
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    assert await post(cluster.gateway_url + "/v1/completions", body,
                      {"traceparent": traceparent}) == 200
    assert {hex_trace(s) for s in spans.get_finished_spans()} == {CLIENT_TRACE}


@pytest.fixture
async def receiver() -> AsyncIterator[OTLPReceiver]:
    r = OTLPReceiver()
    await r.start()
    yield r
    await r.close()


async def test_spans_reach_an_otlp_http_receiver(
    start_cluster: StartCluster, receiver: OTLPReceiver
) -> None:
    worker = dataclasses.replace(FAST_WORKER, otel_endpoint=receiver.url)
    cluster = await start_cluster(workers=1, worker_settings=worker,
                                  otel_endpoint=receiver.url, otel_protocol="http")
    body = {"model": MODEL, "prompt": PREFIX, "max_tokens": 2}
    assert await post(cluster.gateway_url + "/v1/completions", body,
                      {"x-request-id": "traced-1"}) == 200
    await cluster.close()  # shutting down flushes the batch exporters
    assert receiver.requests >= 2
    services = {s.service for s in receiver.spans}
    assert services == {"affinity-gateway", "affinity-worker"}
    server = next(s for s in receiver.spans if s.name == "POST /v1/completions"
                  and s.service == "affinity-gateway")
    assert server.attributes["affinity.request_id"] == "traced-1"
    assert server.attributes["affinity.decision.kind"] == "cold"
    same_trace = {s.name for s in receiver.spans if s.trace_id == server.trace_id}
    assert {"route", "upstream", "queue", "prefill", "decode"} <= same_trace
