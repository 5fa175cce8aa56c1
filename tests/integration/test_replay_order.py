"""The replay's senders: a request that waits for its session's previous one is sent only
once that one was answered; the others go as soon as a sender is free."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from loadtest.harness import replay
from tests.conftest import free_port, serve


async def test_a_request_is_sent_after_the_answer_it_waits_for() -> None:
    arrived: dict[int, float] = {}
    answered: dict[int, float] = {}

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        arrived[body["i"]] = time.perf_counter()
        await asyncio.sleep(body["delay"])
        answered[body["i"]] = time.perf_counter()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    port = free_port()
    runner = await serve(app, port)
    bodies = [{"i": 0, "delay": 0.2}, {"i": 1, "delay": 0.0}, {"i": 2, "delay": 0.0}]
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            replies = await replay(session, url, bodies, 3, after=[-1, 0, -1])
            assert [r.status for r in replies] == [200, 200, 200]
            assert arrived[1] >= answered[0]  # waited for the answer to 0
            assert arrived[2] < answered[0]  # waited for nothing
            arrived.clear()
            answered.clear()
            await replay(session, url, bodies, 3)  # the trace's order alone: all at once
            assert arrived[1] < answered[0]
            arrived.clear()
            answered.clear()
            await replay(session, url, bodies, 3, after=[-1, 0, -1], think=[0.0, 0.15, 0.0])
            assert arrived[1] - answered[0] >= 0.15 - 0.005  # and then thought it over
            assert arrived[2] < answered[0]
    finally:
        await runner.cleanup()
