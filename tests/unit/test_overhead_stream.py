"""The streaming phase of bench_overhead: its arithmetic, and one round over real HTTP."""

from __future__ import annotations

import os

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtest.overhead_stream import (
    StreamConfig,
    StreamResult,
    stream_bodies,
    stream_round,
    stream_table,
)


def test_per_event_cpu_takes_out_the_requests_own_cost() -> None:
    # Medians: 2.0 ms per stream, 0.5 ms per plain request, 100 events: 15 us per event.
    r = StreamResult(cpu_ms=[2.0, 9.0, 1.0], events=[100, 100, 100], wall_ms=[5.0, 6.0, 7.0])
    assert r.per_event_us(0.5) == 15.0
    assert StreamResult().per_event_us(0.5) == 0.0
    peer = StreamResult(cpu_ms=[0.8], events=[100], wall_ms=[4.0])
    lines = stream_table(StreamConfig(tokens=100, reps=3), {"ours": r, "sglang-router": peer},
                         {"ours": 0.5, "sglang-router": 0.3}, "sglang-router")
    text = "\n".join(lines)
    assert "| ours | 2.000 (2.000, 9.000, 1.000) | 15.0 | 100 | 6.0 | 0 |" in text
    assert "CPU per event over sglang-router's: ours 3.00x" in text
    assert stream_table(StreamConfig(tokens=0), {"ours": r}, {}, "sglang-router") == []


async def test_a_round_counts_events_and_errors_over_http() -> None:
    async def sse(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["messages"][0]["content"].startswith("Story 1:"):
            return web.Response(status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await response.write(b'data: {"choices": []}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", sse)
    config = StreamConfig(tokens=5, requests=4, concurrency=2)
    result = StreamResult()
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        await stream_round(session, str(server.make_url("/v1/chat/completions")), os.getpid(),
                           stream_bodies("m", config, seed=1), config.concurrency, result)
    assert result.errors == 1  # "Story 1" answered 503
    assert result.events == [6 * 3 / 4]  # three streams of 5 tokens and [DONE]
    assert len(result.cpu_ms) == len(result.wall_ms) == 1
