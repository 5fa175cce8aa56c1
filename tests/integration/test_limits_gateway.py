"""Limits through the gateway: the official openai client sees 429 with Retry-After."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.conftest import MODEL, StartCluster

KEYS = ("sk-acme:acme", "sk-globex:globex", "sk-initech:initech", "sk-umbrella:umbrella")


def client(base_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def test_request_rate_per_tenant(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS, tenant_rpm=3)
    async with client(cluster.base_url, "sk-acme") as acme, \
            client(cluster.base_url, "sk-globex") as globex:
        for _ in range(3):
            await acme.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as caught:
            await acme.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert int(caught.value.response.headers["Retry-After"]) >= 1
        body = caught.value.body
        assert isinstance(body, dict)
        assert body["code"] == "rate_limit_exceeded"
        assert body["type"] == "rate_limit_error"
        # The other tenant has its own bucket.
        await globex.completions.create(model=MODEL, prompt="hi", max_tokens=1)


async def test_token_rate_counts_every_prompt_of_a_batch(start_cluster: StartCluster) -> None:
    # 64 prompts of ~10 tokens with max_tokens 16 cost ~1,660 tokens; one prompt costs ~26.
    cluster = await start_cluster(workers=1, api_key=KEYS, tenant_tpm=2000)
    async with client(cluster.base_url, "sk-acme") as acme:
        batch = await acme.completions.create(model=MODEL, prompt=["x" * 40] * 64, max_tokens=16)
        assert len(batch.choices) == 64
        with pytest.raises(openai.RateLimitError, match="tokens per minute"):
            await acme.completions.create(model=MODEL, prompt=["x" * 40] * 64, max_tokens=16)
        await acme.completions.create(model=MODEL, prompt="x" * 40, max_tokens=16)


async def test_concurrency_per_tenant_and_global_queue(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS, tenant_concurrency=1,
                                  max_inflight=2, max_queue=1)
    async with client(cluster.base_url, "sk-acme") as acme, \
            client(cluster.base_url, "sk-globex") as globex, \
            client(cluster.base_url, "sk-initech") as initech, \
            client(cluster.base_url, "sk-umbrella") as umbrella:
        long = await acme.completions.create(model=MODEL, prompt="a", max_tokens=2000,
                                             stream=True)
        first = await long.__anext__()  # acme now has one request in flight
        assert first is not None
        with pytest.raises(openai.RateLimitError) as caught:
            await acme.completions.create(model=MODEL, prompt="b", max_tokens=1)
        assert caught.value.body["code"] == "concurrency_limit_exceeded"  # type: ignore[index]
        # Global: acme's and globex's streams run, initech's request waits, umbrella's is
        # refused (the queue holds one).
        second = await globex.completions.create(model=MODEL, prompt="c", max_tokens=2000,
                                                 stream=True)
        await second.__anext__()
        queued = asyncio.create_task(
            initech.completions.create(model=MODEL, prompt="d", max_tokens=1))
        await asyncio.sleep(0.2)
        assert not queued.done()
        with pytest.raises(openai.RateLimitError) as caught:
            await umbrella.completions.create(model=MODEL, prompt="e", max_tokens=1)
        assert caught.value.body["code"] == "server_overloaded"  # type: ignore[index]
        await long.close()  # its place goes to the queued request
        done = await asyncio.wait_for(queued, 30)
        assert done.choices[0].text is not None
        await second.close()


async def test_a_tenant_over_its_rate_is_refused_before_its_body_is_read(
    start_cluster: StartCluster,
) -> None:
    """A request its tenant's limits refuse whatever it costs is answered at once, its body
    unread: here a body that never arrives (the gateway would wait for it, up to its body
    timeout, before any parse)."""
    cluster = await start_cluster(workers=1, api_key=KEYS, tenant_rpm=1, body_timeout_s=60.0)
    async with client(cluster.base_url, "sk-acme") as acme:
        await acme.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    port = int(cluster.gateway_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                     b"Authorization: Bearer sk-acme\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"model\": ")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        assert head.startswith(b"HTTP/1.1 429 ")
        assert b"retry-after:" in head.lower()
    finally:
        writer.close()


async def test_request_bodies_held_at_once_are_bounded(start_cluster: StartCluster) -> None:
    """Past ``--max-held-body-bytes`` held by requests in flight, a body that does not fit is
    refused with 429 before it is read (declared or chunked); a running stream holds its body's
    bytes until it ends, and then the budget is whole again."""
    cluster = await start_cluster(workers=1, api_key=KEYS, max_held_body_bytes=4500,
                                  max_body_bytes=3000, body_timeout_s=60.0)
    port = int(cluster.gateway_url.rsplit(":", 1)[1])
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
            b"Authorization: Bearer sk-acme\r\nContent-Type: application/json\r\n")

    async def refused_unread(extra: bytes, body: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head + extra + b"\r\n" + body)
            await writer.drain()
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        finally:
            writer.close()

    async with client(cluster.base_url, "sk-acme") as acme, \
            client(cluster.base_url, "sk-globex") as globex:
        prompt = "p" * 2400
        long = await acme.completions.create(model=MODEL, prompt=prompt, max_tokens=2000,
                                             stream=True)
        assert await long.__anext__() is not None  # ~2,450 bytes held while it streams
        answer = await refused_unread(b"Content-Length: 2900\r\n", b'{"model": ')
        assert answer.startswith(b"HTTP/1.1 429 ")
        assert b"retry-after: 1" in answer.lower()
        with pytest.raises(openai.RateLimitError) as caught:
            await globex.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert caught.value.body["code"] == "server_overloaded"  # type: ignore[index]
        # A chunked body is counted as it arrives: refused at the chunk that does not fit.
        chunk = b"%x\r\n" % 1500 + b" " * 1500 + b"\r\n"
        answer = await refused_unread(b"Transfer-Encoding: chunked\r\n", chunk * 2)
        assert answer.startswith(b"HTTP/1.1 429 ")
        small = await globex.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert small.choices  # what fits beside the stream is served
        await long.close()
        for _ in range(100):  # the stream's end gives its bytes back
            async with aiohttp.ClientSession() as http, \
                    http.get(cluster.gateway_url + "/metrics") as r:
                text = await r.text()
            if "gateway_held_body_bytes 0.0" in text:
                break
            await asyncio.sleep(0.05)
        assert "gateway_held_body_bytes 0.0" in text
        assert "gateway_body_budget_refusals_total 3.0" in text
        assert "gateway_held_body_bytes_budget 4500.0" in text
        done = await globex.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert done.choices
