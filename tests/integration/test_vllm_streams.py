"""Streams to ``vllm+http://`` workers report their cache hits: the gateway asks for
``stream_options.include_usage`` and holds the usage event back from a client that did not ask.

The upstream here stands in for vLLM's wire behaviour (no ``x-cache-*`` headers; cached tokens
only in ``usage.prompt_tokens_details``; the usage event only when asked), which our reference
worker does not have.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
from aiohttp import web

from tests.conftest import MODEL, Cluster, StartCluster, engine_stub, free_port, serve


class VLLMLike:
    def __init__(self, long_text: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.long_text = long_text  # characters of one more token event, sent in pieces

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        words = ["alpha", " beta", " gamma"] + (["x" * self.long_text] if self.long_text else [])
        for word in words:
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                     "choices": [{"index": 0, "text": word, "finish_reason": None}]}
            # Event boundaries and network chunks need not coincide.
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            await response.write(data[:7])
            for at in range(7, len(data), 1 << 16):
                await response.write(data[at:at + (1 << 16)])
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                     "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                              "total_tokens": 43,
                                              "prompt_tokens_details": {"cached_tokens": 32}}}
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def app(self) -> web.Application:
        app = engine_stub()
        app.router.add_post("/v1/completions", self.completions)
        return app


@contextlib.asynccontextmanager
async def _in_front_of(upstream: VLLMLike, start_cluster: StartCluster) -> AsyncIterator[Cluster]:
    """A gateway whose one worker is ``upstream`` (as ``vllm+http://``)."""
    port = free_port()
    runner = await serve(upstream.app(), port)
    try:
        yield await start_cluster(workers=0, worker=(f"vllm+http://127.0.0.1:{port}",))
    finally:
        await runner.cleanup()


async def _streamed(gateway_url: str, max_tokens: int) -> tuple[bytes, list[bytes]]:
    """A streamed completion through the gateway: the bytes, and its events."""
    async with aiohttp.ClientSession() as http, http.post(
        gateway_url + "/v1/completions",
        json={"model": MODEL, "prompt": "p", "max_tokens": max_tokens, "stream": True},
    ) as r:
        raw = await r.read()
    return raw, [e for e in raw.split(b"\n\n") if e]


async def test_vllm_streams_report_hits_without_changing_what_the_client_sees(
    start_cluster: StartCluster,
) -> None:
    upstream = VLLMLike()
    async with _in_front_of(upstream, start_cluster) as cluster:
        raw, events = await _streamed(cluster.gateway_url, max_tokens=3)
        assert events[-1] == b"data: [DONE]"
        assert len(events) == 4  # three tokens and [DONE]: no usage event
        assert b"usage" not in raw
        assert upstream.bodies[0]["stream_options"] == {"include_usage": True}
        # A client that asks gets the usage event, exactly once.
        async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k",
                                      max_retries=0) as oa:
            stream = await oa.completions.create(
                model=MODEL, prompt="p", max_tokens=3, stream=True,
                stream_options={"include_usage": True})
            usages = [c.usage async for c in stream if c.usage is not None]
        assert len(usages) == 1
        assert usages[0].prompt_tokens_details is not None
        assert usages[0].prompt_tokens_details.cached_tokens == 32
        async with aiohttp.ClientSession() as http, http.get(
            cluster.gateway_url + "/admin/workers"
        ) as r:
            view = (await r.json())["workers"][0]
        # Both streams were seen by telemetry, the one whose client did not ask included.
        assert view["input_tokens"] == 80
        assert view["matched_tokens"] == 64


async def test_an_event_longer_than_any_usage_report_is_relayed_whole(
    start_cluster: StartCluster,
) -> None:
    """An event of 3 MiB, sent in 64 KiB pieces (the relay passes on what waits for an
    event's end once it is longer than a usage report could be): the client gets it whole,
    and the usage event after it is still held back."""
    async with _in_front_of(VLLMLike(long_text=3 << 20), start_cluster) as cluster:
        raw, events = await _streamed(cluster.gateway_url, max_tokens=4)
        assert events[-1] == b"data: [DONE]"
        assert len(events) == 5  # four tokens and [DONE]
        assert json.loads(events[3].removeprefix(b"data: "))["choices"][0]["text"] == (
            "x" * (3 << 20))
        assert b"usage" not in raw
