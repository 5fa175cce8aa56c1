"""The gateway end to end: the official openai client -> gateway -> 4 reference workers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from loadtest.harness import server_timing
from tests.conftest import MODEL, StartCluster

SHARED_PREFIX = (
    "You are the support assistant of a company that sells bicycles. Answer politely, cite the "
    "manual when you can, and never invent part numbers. "
) * 14  # about 2,000 characters


def client(base_url: str, key: str = "test-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def test_chat_completions_and_models_through_openai_client(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    async with client(cluster.base_url) as oa:
        models = await oa.models.list()
        assert [m.id for m in models.data] == [MODEL]
        raw = await oa.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hello there"}],
            max_tokens=5,
        )
        chat = raw.parse()
    assert chat.choices[0].message.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5
    headers = raw.headers
    assert headers["x-route-policy"] == "cache_aware"
    assert headers["x-route-worker"] in {u.removeprefix("http://") for u in cluster.worker_urls}
    assert headers["x-route-reason"].startswith("cold")
    assert len(headers["x-prefix-anchor"]) == 16
    assert headers["x-prefix-match-blocks"] == "0"
    # Where the gateway's time went: arrival to decision, decision to the worker's reply.
    timing = server_timing(headers["Server-Timing"])
    assert set(timing) == {"wait", "upstream"}
    assert all(ms >= 0.0 for ms in timing.values())
    # The decision's instant, on the monotonic clock this test shares with the gateway, and
    # (relayed from the worker) when its engine freed the request's blocks, after it.
    decided = float(headers["x-route-at"])
    assert 0.0 < decided <= float(headers["x-engine-done-at"]) <= time.monotonic()
    assert decided <= float(headers["x-engine-computed-at"]) <= float(headers["x-engine-done-at"])
    for name in ("x-cache-input-tokens", "x-cache-matched-tokens", "x-cache-matched-blocks",
                 "x-cache-hit-ratio"):
        assert name in headers


async def test_completions_non_streaming_and_streaming(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    async with client(cluster.base_url) as oa:
        done = await oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
        assert done.choices[0].text
        pieces: list[str] = []
        usage = None
        stream = await oa.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            pieces.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
    assert len([p for p in pieces if p]) == 6
    assert usage is not None
    assert usage.completion_tokens == 6


async def test_several_samples_of_one_prompt(start_cluster: StartCluster) -> None:
    """``n`` > 1 through the gateway: every sample comes back, streamed or whole, the worker's
    report counts the prompt once, and nothing stays counted in flight."""
    cluster = await start_cluster(workers=2)
    messages: list[Any] = [{"role": "system", "content": SHARED_PREFIX},
                           {"role": "user", "content": "Which saddle fits a child?"}]
    async with client(cluster.base_url) as oa, aiohttp.ClientSession() as http:
        raw = await oa.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4, n=3)
        whole = raw.parse()
        stream = await oa.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, n=2, stream=True)
        streamed: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (
                    choice.delta.content or "")
        async with http.get(cluster.gateway_url + "/admin/workers") as r:
            view = await r.json()
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 3
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 12
    assert int(raw.headers["x-cache-input-tokens"]) == whole.usage.prompt_tokens
    assert sorted(streamed) == [0, 1]
    assert all(streamed.values())
    assert sum(w["inflight_requests"] for w in view["workers"]) == 0


async def test_stop_sequences_through_the_gateway(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    async with client(cluster.base_url) as oa:
        free = await oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
        text = free.choices[0].text
        stop = text.split(" ")[3]  # the third generated word
        cut = await oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                          stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_chat_streaming_is_relayed_chunk_by_chunk(start_cluster: StartCluster) -> None:
    """The first chunk reaches the client while the worker is still generating."""
    cluster = await start_cluster(workers=1)
    async with client(cluster.base_url) as oa, aiohttp.ClientSession() as http:
        stream = await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count to fifty"}],
            max_tokens=50, stream=True,
        )
        chunks = 0
        inflight_at_first_chunk = None
        async for chunk in stream:
            if chunks == 0:
                async with http.get(cluster.gateway_url + "/admin/workers") as r:
                    view = await r.json()
                inflight_at_first_chunk = view["workers"][0]["inflight_requests"]
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
    assert inflight_at_first_chunk == 1  # still generating: the gateway did not buffer
    assert chunks == 50


async def test_shared_prefix_sticks_to_one_worker_and_hits_its_cache(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    workers: list[str] = []
    matched: list[int] = []
    async with client(cluster.base_url) as oa:
        for i in range(20):
            raw = await oa.completions.with_raw_response.create(
                model=MODEL, prompt=f"{SHARED_PREFIX}\nQuestion {i}: how do I fix gear {i}?",
                max_tokens=2,
            )
            workers.append(raw.headers["x-route-worker"])
            matched.append(int(raw.headers["x-cache-matched-tokens"]))
            body = raw.parse()
            assert body.usage is not None
    assert len(set(workers)) == 1
    assert matched[0] == 0
    assert all(m > 0 for m in matched[1:]), matched


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"policy": "prefix_affinity", "load_factor": 1.25}, id="prefix_affinity-1.25"),
        # The reference workers start requests at once: the bound under test must hold
        # however quick their first tokens (quick_first_token_s off).
        pytest.param({"policy": "cache_aware", "cache_aware_load_factor": 1.25,
                      "quick_first_token_s": 0.0}, id="cache_aware-1.25"),
        pytest.param({"policy": "cache_aware", "quick_first_token_s": 0.0},
                     id="cache_aware-default"),
    ],
)
async def test_shared_system_prompt_spreads_within_the_load_bound(
    start_cluster: StartCluster, overrides: dict[str, object]
) -> None:
    """60 users share one system prompt, 16 at a time: no worker exceeds c x mean + 1 request."""
    cluster = await start_cluster(**overrides)
    semaphore = asyncio.Semaphore(16)
    loads: list[tuple[str, int, int]] = []

    async def one(oa: openai.AsyncOpenAI, user: int) -> None:
        async with semaphore:
            raw = await oa.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": SHARED_PREFIX},
                    {"role": "user", "content": f"I am user {user}; my bike {user} squeaks."},
                ],
                max_tokens=20,
            )
            fields = dict(p.split("=") for p in raw.headers["x-route-load"].split(";"))
            loads.append((raw.headers["x-route-worker"], int(fields["tokens"]),
                          int(fields["bound"])))

    async with client(cluster.base_url) as oa:
        await asyncio.gather(*(one(oa, u) for u in range(60)))
    assert len(loads) == 60
    for worker, tokens, bound in loads:
        assert tokens <= bound, (worker, tokens, bound)
    used = {w for w, _, _ in loads}
    assert len(used) >= 2, "the shared prompt piled onto one worker"
    # The bound did bite: some request saw a loaded pool (more than its own load in flight).
    assert max(t for _, t, _ in loads) > min(t for _, t, _ in loads)


async def test_invisible_differences_share_one_cache_entry(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    plain = SHARED_PREFIX + "\nWhich tyre fits?"
    noisy = SHARED_PREFIX.replace(" ", "\u00a0", 5).replace("the", "th\u200be", 3) + (
        "\r\nWhich tyre fits?   \n"
    )
    async with client(cluster.base_url) as oa:
        first = await oa.completions.with_raw_response.create(
            model=MODEL, prompt=plain, max_tokens=1)
        second = await oa.completions.with_raw_response.create(
            model=MODEL, prompt=noisy, max_tokens=1)
    assert first.headers["x-prefix-anchor"] == second.headers["x-prefix-anchor"]
    assert first.headers["x-route-worker"] == second.headers["x-route-worker"]
    assert first.headers["x-cache-input-tokens"] == second.headers["x-cache-input-tokens"]
    assert second.headers["x-cache-matched-tokens"] == second.headers["x-cache-input-tokens"] or (
        int(second.headers["x-cache-matched-tokens"]) > 0
    )


@pytest.mark.parametrize("trim", [True, False])
async def test_a_re_render_with_trailing_spaces_on_inner_lines_still_hits(
    start_cluster: StartCluster, trim: bool
) -> None:
    """An agent re-sends the same context with trailing spaces on inner lines: trimmed per line
    (the default), it is the same prefix and the worker reuses all of it."""
    cluster = await start_cluster(trim_line_whitespace=trim)
    lines = [f"{SHARED_PREFIX[i:i + 60]}" for i in range(0, len(SHARED_PREFIX), 60)]
    plain = "\n".join(line.rstrip() for line in lines) + "\nWhich tyre fits?"
    rerender = "\n".join(line.rstrip() + "  " for line in lines) + "\nWhich tyre fits?"
    async with client(cluster.base_url) as oa:
        first = await oa.completions.with_raw_response.create(
            model=MODEL, prompt=plain, max_tokens=1)
        second = await oa.completions.with_raw_response.create(
            model=MODEL, prompt=rerender, max_tokens=1)
    matched = int(second.headers["x-cache-matched-tokens"])
    total = int(second.headers["x-cache-input-tokens"])
    if trim:
        assert second.headers["x-cache-input-tokens"] == first.headers["x-cache-input-tokens"]
        assert matched * 10 >= total * 9, (matched, total)  # all but the last partial block
    else:
        assert matched * 10 < total * 2, (matched, total)  # a new prefix from line one on


async def test_tenants_are_namespaced(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    anchors = []
    for key in ("tenant-a", "tenant-b"):
        async with client(cluster.base_url, key=key) as oa:
            raw = await oa.completions.with_raw_response.create(
                model=MODEL, prompt=SHARED_PREFIX, max_tokens=1)
            anchors.append(raw.headers["x-prefix-anchor"])
    assert anchors[0] != anchors[1]


async def test_refused_worker_is_skipped_before_any_byte(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=4)
    dead = cluster.worker_urls[0]
    await cluster.stop_worker(dead)  # the gateway still believes it is healthy
    seen: set[str] = set()
    async with client(cluster.base_url) as oa:
        for i in range(24):
            raw = await oa.completions.with_raw_response.create(
                model=MODEL, prompt=f"prompt number {i} " * 8, max_tokens=1)
            assert raw.http_response.status_code == 200
            seen.add(raw.headers["x-route-worker"])
    assert dead.removeprefix("http://") not in seen
    async with aiohttp.ClientSession() as http, http.get(
        cluster.gateway_url + "/admin/workers"
    ) as r:
        view = await r.json()
    states = {w["id"]: w for w in view["workers"]}
    assert states[dead.removeprefix("http://")]["healthy"] is False


async def test_no_healthy_worker_is_503_with_retry_after(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=0, dead_workers=2)
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.base_url + "/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        }) as r:
            assert r.status == 503
            assert r.headers["Retry-After"]
            body = await r.json()
        async with http.get(cluster.gateway_url + "/ready") as ready:
            assert ready.status == 503
        async with http.get(cluster.gateway_url + "/health") as alive:
            assert alive.status == 200
    assert body["error"]["code"] == "no_healthy_worker"


BAD_REQUESTS = [
    pytest.param("/v1/chat/completions", b"{not json", 400, None, id="malformed-json"),
    pytest.param("/v1/chat/completions", b"[1, 2]", 400, None, id="json-not-object"),
    pytest.param("/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "hi"}]}).encode(), 400, "model", id="missing-model"),
    pytest.param("/v1/chat/completions", json.dumps({"model": 7, "messages": [
        {"role": "user", "content": "hi"}]}).encode(), 400, "model", id="model-not-string"),
    pytest.param("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "messages",
                 id="missing-messages"),
    pytest.param("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(),
                 400, "messages", id="messages-not-list"),
    pytest.param("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "wizard", "content": "hi"}]}).encode(), 400, "messages[0].role", id="bad-role"),
    pytest.param("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": 5}]}).encode(), 400, "messages[0].content",
                 id="content-number"),
    pytest.param("/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": "ten",
        "messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "max_tokens",
                 id="max-tokens-string"),
    pytest.param("/v1/chat/completions", json.dumps({"model": MODEL, "stream": "yes",
        "messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "stream",
                 id="stream-not-bool"),
    pytest.param("/v1/completions", json.dumps({"model": MODEL}).encode(), 400, "prompt",
                 id="missing-prompt"),
    pytest.param("/v1/completions", json.dumps({"model": MODEL, "prompt": 3.5}).encode(), 400,
                 "prompt", id="prompt-number"),
    pytest.param("/v1/completions", json.dumps({"model": "no-such-model", "prompt": "x"}).encode(),
                 404, "model", id="unknown-model"),
    pytest.param("/v1/completions", b'{"model": "sim-model", "prompt": "' + b"x" * 70_000 + b'"}',
                 413, None, id="body-too-large"),
    pytest.param("/v1/nothing-here", b"{}", 404, None, id="unknown-route"),
]


@pytest.mark.parametrize(("path", "payload", "status", "param"), BAD_REQUESTS)
async def test_bad_input_gets_openai_shaped_4xx(
    start_cluster: StartCluster, path: str, payload: bytes, status: int, param: str | None
) -> None:
    cluster = await start_cluster(workers=1, max_body_bytes=64 * 1024)
    async with aiohttp.ClientSession() as http, http.post(
        cluster.gateway_url + path, data=payload, headers={"Content-Type": "application/json"}
    ) as r:
        body = await r.json()
        assert r.status == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param


async def _chunks(body: bytes, size: int) -> AsyncIterator[bytes]:
    for at in range(0, len(body), size):
        yield body[at:at + size]
        await asyncio.sleep(0)


async def test_body_sent_in_chunks_is_read_whole_up_to_the_limit(
    start_cluster: StartCluster,
) -> None:
    """A body without Content-Length (chunked) arrives in pieces: under the limit the gateway
    reads all of it; one byte over, it answers 413 in the OpenAI shape."""
    limit = 64 * 1024
    cluster = await start_cluster(workers=1, max_body_bytes=limit)
    head = json.dumps({"model": MODEL, "max_tokens": 1, "prompt": ""}).encode()[:-2]
    tail = b'"}'
    fits = head + b"x" * (limit - len(head) - len(tail)) + tail
    over = head + b"x" * (limit + 1 - len(head) - len(tail)) + tail
    async with aiohttp.ClientSession() as http:
        for body, status in ((fits, 200), (over, 413)):
            async with http.post(cluster.gateway_url + "/v1/completions",
                                 data=_chunks(body, 5000),
                                 headers={"Content-Type": "application/json"}) as r:
                reply = await r.json()
                assert r.status == status, reply
                assert "Content-Length" not in r.request_info.headers
        assert reply["error"]["type"] == "invalid_request_error"
        assert str(limit) in reply["error"]["message"]


async def test_wrong_method_is_405(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    async with aiohttp.ClientSession() as http, http.get(
        cluster.base_url + "/chat/completions"
    ) as r:
        assert r.status == 405
        assert (await r.json())["error"]["code"] == "method_not_allowed"
