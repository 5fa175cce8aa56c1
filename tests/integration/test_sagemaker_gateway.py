"""The gateway end to end to SageMaker targets: openai client -> gateway -> aiobotocore ->
our SageMaker-runtime server (real wire format: event-stream frames, session headers, errors)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import FAST_WORKER, MODEL, StartCluster, free_port, serve
from tests.sagemaker_server import (
    EchoContainer,
    SageMakerRuntimeServer,
    WorkerContainer,
    aws_test_env,
    target_url,
)
from worker.server import create_app as create_worker

PREFIX = "You are the assistant of a bicycle shop; answer from the manual. " * 8  # > 4 blocks


@pytest.fixture(autouse=True)
def _aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in aws_test_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
async def runtime() -> AsyncIterator[tuple[SageMakerRuntimeServer, str]]:
    server = SageMakerRuntimeServer(max_part=5)
    port = free_port()
    runner = await serve(server.app(), port)
    yield server, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)


async def two_variants(
    start_cluster: StartCluster, server: SageMakerRuntimeServer, base: str, shape: str = "openai",
    **params: str,
) -> tuple[Any, dict[str, str]]:
    """Endpoint ``ep`` with variants A and B (two echo instances each), both gateway targets."""
    server.add_endpoint("ep", {v: [EchoContainer(shape), EchoContainer(shape)] for v in "AB"})
    urls = {v: target_url("ep", base, variant=v, body=shape, **params) for v in "AB"}
    cluster = await start_cluster(workers=0, worker=tuple(urls.values()))
    return cluster, {"sm:us-east-1/ep/" + v: v for v in urls}


async def test_chat_non_streaming_sends_the_anchor_as_prefix_aware_id(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    server, base = runtime
    cluster, ids = await two_variants(start_cluster, server, base)
    async with client(cluster.base_url) as oa:
        assert [m.id for m in (await oa.models.list()).data] == [MODEL]
        raw = await oa.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=3, extra_headers={"x-request-id": "req-1"},
            messages=[{"role": "user", "content": "alpha beta gamma delta"}],
        )
    chat = raw.parse()
    assert chat.choices[0].message.content == "alpha beta gamma"
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 3
    (call,) = server.calls
    assert call.operation == "invoke"
    assert call.variant == ids[raw.headers["x-route-worker"]]
    assert call.prefix_aware_id == raw.headers["x-prefix-anchor"]
    assert call.inference_id == "req-1"


@pytest.mark.parametrize("shape", ["openai", "tgi"])
async def test_streaming_chat_and_completions_are_resplit_into_sse(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str], shape: str
) -> None:
    server, base = runtime
    cluster, _ = await two_variants(start_cluster, server, base, shape)
    async with client(cluster.base_url) as oa:
        stream = await oa.chat.completions.create(
            model=MODEL, max_tokens=12, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "un deux trois quatre cinq six sept"}],
        )
        pieces: list[str] = []
        usage = None
        async for chunk in stream:
            pieces.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        text = await oa.completions.create(model=MODEL, prompt="ein zwei drei", max_tokens=4,
                                           stream=True)
        completion = "".join([c.choices[0].text async for c in text if c.choices])
    assert "".join(pieces) == "un deux trois quatre cinq six sept un deux trois quatre cinq"
    assert len([p for p in pieces if p]) == 12  # one chunk per token, none split or merged
    if shape == "tgi":
        assert usage is not None
        assert usage.completion_tokens == 12
    assert completion == "ein zwei drei ein"
    assert {c.operation for c in server.calls} == {"stream"}


async def test_tgi_body_is_mapped_both_ways(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    server, base = runtime
    cluster, _ = await two_variants(start_cluster, server, base, "tgi")
    async with client(cluster.base_url) as oa:
        done = await oa.completions.create(model=MODEL, prompt="one two", max_tokens=3,
                                           temperature=0)
    assert done.choices[0].text == "one two one"
    assert done.object == "text_completion"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2, 3)
    sent = [r for v in server.endpoints["ep"].variants.values() for c in v.instances
            for r in getattr(c, "requests", [])]
    assert sent == [{"inputs": "one two", "stream": False, "parameters": {
        "details": True, "return_full_text": False, "max_new_tokens": 3, "do_sample": False}}]


async def test_sessions_open_on_a_hot_prefix_are_reused_and_forgotten(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    server, base = runtime
    server.add_endpoint("ep", {"A": [EchoContainer() for _ in range(3)]})
    url = target_url("ep", base, variant="A", session="auto", session_after="2",
                     prefix_aware="off")
    cluster = await start_cluster(workers=0, worker=(url,))

    async def ask(oa: openai.AsyncOpenAI, i: int, stream: bool = False) -> None:
        messages: Any = [{"role": "system", "content": PREFIX},
                         {"role": "user", "content": f"question {i}"}]
        if stream:
            async for _ in await oa.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, stream=True
            ):
                pass
        else:
            await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)

    async with client(cluster.base_url) as oa:
        await ask(oa, 1)  # first sight of the prefix: no session
        await ask(oa, 2)  # hot: opens one
        (sid,) = server.sessions
        await ask(oa, 3, stream=True)  # streams reuse it (they cannot open one)
        await ask(oa, 4)
        assert [c.session for c in server.calls] == ["", "NEW_SESSION", sid, sid]
        assert len({c.instance for c in server.calls[1:]}) == 1  # pinned to one instance
        server.expire_session(sid)
        await ask(oa, 5)  # rejected session: forgotten, the call goes again without it
        assert [(c.session, c.status) for c in server.calls[4:]] == [(sid, 400), ("", 200)]
        await ask(oa, 6)  # still hot: a new session
        (sid2,) = [s for s in server.sessions if s != sid]
        server.close_session(sid2)
        await ask(oa, 7)  # the answer says the session closed
        await ask(oa, 8)
    assert [c.session for c in server.calls[6:]] == ["NEW_SESSION", sid2, "NEW_SESSION"]


@pytest.mark.parametrize(
    ("code", "stream"),
    [
        pytest.param("ThrottlingException", False, id="throttling"),
        pytest.param("ThrottlingException", True, id="throttling-stream"),
        pytest.param("ModelNotReadyException", False, id="model-not-ready"),
        pytest.param("ServiceUnavailable", True, id="service-unavailable-stream"),
        pytest.param("InternalFailure", False, id="internal-failure"),
    ],
)
async def test_retryable_errors_go_to_the_other_target_before_any_byte(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str], code: str,
    stream: bool,
) -> None:
    server, base = runtime
    cluster, ids = await two_variants(start_cluster, server, base)
    server.inject("ep", code, 1)
    async with aiohttp.ClientSession() as http, http.post(
        cluster.base_url + "/chat/completions",
        json={"model": MODEL, "max_tokens": 2, "stream": stream,
              "messages": [{"role": "user", "content": "hello there"}]},
    ) as r:
        body = await r.read()
        assert r.status == 200, body
        worker = r.headers["x-route-worker"]
    first, second = server.calls
    assert (first.error, second.error) == (code, "")
    assert first.variant != second.variant == ids[worker]
    if stream:
        assert body.endswith(b"data: [DONE]\n\n")


async def test_every_target_throttled_is_a_502_naming_each(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    server, base = runtime
    cluster, _ = await two_variants(start_cluster, server, base)
    server.inject("ep", "ThrottlingException", 5)
    async with client(cluster.base_url) as oa:
        with pytest.raises(openai.APIStatusError) as info:
            await oa.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert info.value.status_code == 502
    assert "sm:us-east-1/ep/A: HTTP 429" in str(info.value)
    assert "sm:us-east-1/ep/B: HTTP 429" in str(info.value)
    assert len(server.calls) == 2


@pytest.mark.parametrize(
    ("original_status", "original_message", "status", "message"),
    [
        pytest.param(500, "CUDA out of memory", 424, "CUDA out of memory", id="model-5xx"),
        pytest.param(400, '{"error": {"message": "context too long", "type": "BadRequest", '
                     '"param": null, "code": 400}}', 400, "context too long", id="model-4xx"),
    ],
)
async def test_model_error_is_not_retried(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str],
    original_status: int, original_message: str, status: int, message: str,
) -> None:
    server, base = runtime
    cluster, _ = await two_variants(start_cluster, server, base)
    server.inject("ep", "ModelError", 1, original_status=original_status,
                  original_message=original_message)
    async with client(cluster.base_url) as oa:
        with pytest.raises(openai.APIStatusError) as info:
            await oa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert info.value.status_code == status
    assert message in str(info.value)
    assert len(server.calls) == 1


@pytest.mark.parametrize("kind", ["ModelStreamError", "InternalStreamFailure"])
async def test_stream_failure_ends_the_stream_with_an_error_event(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str], kind: str
) -> None:
    server, base = runtime
    cluster, _ = await two_variants(start_cluster, server, base)
    server.fail_stream("ep", after_parts=200, kind=kind)
    pieces: list[str] = []
    async with client(cluster.base_url) as oa:
        stream = await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a b c d e f g h"}],
            max_tokens=30, stream=True)

        async def drain() -> None:
            async for chunk in stream:
                pieces.extend(c.delta.content or "" for c in chunk.choices)

        with pytest.raises(openai.APIError, match=kind):
            await drain()
    assert pieces  # some tokens arrived before the failure
    assert len(server.calls) == 1  # never retried once streaming began


async def test_probe_keeps_an_endpoint_that_is_not_in_service_out(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    server, base = runtime
    server.add_endpoint("ep", {"A": [EchoContainer()]}).status = "Creating"
    cluster = await start_cluster(workers=0, worker=(target_url("ep", base, variant="A"),
                                                     target_url("ep", base, variant="Z")))
    async with aiohttp.ClientSession() as http, http.get(
        cluster.gateway_url + "/admin/workers"
    ) as r:
        view = await r.json()
    errors = {w["id"]: (w["healthy"], w["last_error"]) for w in view["workers"]}
    assert errors == {"sm:us-east-1/ep/A": (False, "endpoint is Creating"),
                      "sm:us-east-1/ep/Z": (False, "endpoint is Creating")}
    server.endpoints["ep"].status = "InService"
    # (the next health round would bring A up; Z stays out: the endpoint has no such variant)


async def test_reference_worker_behind_sagemaker_streams_through(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    server, base = runtime
    port = free_port()
    worker = await serve(create_worker(dataclasses.replace(FAST_WORKER, port=port)), port)
    try:
        server.add_endpoint("ep", {"A": [WorkerContainer(f"http://127.0.0.1:{port}")]})
        cluster = await start_cluster(workers=0, worker=(target_url("ep", base, variant="A"),))
        async with client(cluster.base_url) as oa:
            stream = await oa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "count to ten"}],
                max_tokens=10, stream=True)
            chunks = [c async for c in stream]
            done = await oa.completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 10
        assert done.usage is not None
        assert done.usage.completion_tokens == 3
    finally:
        await worker.cleanup()


async def test_trace_context_goes_to_sagemaker_as_custom_attributes(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str]
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    server, base = runtime
    server.add_endpoint("ep", {"A": [EchoContainer("openai")]})
    spans = InMemorySpanExporter()
    cluster = await start_cluster(workers=0, worker=(target_url("ep", base, variant="A"),),
                                  span_exporter=spans)
    async with client(cluster.base_url) as oa:
        await oa.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "one two three"}])
    (call,) = server.calls
    (upstream,) = [s for s in spans.get_finished_spans() if s.name == "upstream"]
    assert upstream.context is not None
    trace_id, span_id = f"{upstream.context.trace_id:032x}", f"{upstream.context.span_id:016x}"
    assert call.custom_attributes.startswith(f"traceparent=00-{trace_id}-{span_id}-")


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}, 404, "not_found"),
    ("/v1/responses", {"model": MODEL, "input": "hi"}, 503, "no_healthy_worker"),
])
async def test_what_is_not_a_completion_is_not_sent_to_sagemaker_endpoints(
    start_cluster: StartCluster, runtime: tuple[SageMakerRuntimeServer, str], path: str,
    body: dict[str, Any], status: int, code: str,
) -> None:
    server, base = runtime
    cluster, _ = await two_variants(start_cluster, server, base)
    async with aiohttp.ClientSession() as http, http.post(
            cluster.gateway_url + path, json=body) as r:
        assert r.status == status
        assert (await r.json())["error"]["code"] == code
    assert server.calls == []  # an endpoint takes completions only
