"""The worker registry and the prefix index survive a Redis flush and a gateway restart.

Real redis-server, real workers registering themselves, gateways on 127.0.0.1. A missing registry
entry alone (FLUSHALL, a Redis restart) does not remove a worker the health probes find alive;
a gateway that starts rebuilds its prefix index from the assignment stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.resources import SYNC_KEY
from gateway.settings import GatewaySettings
from tests.conftest import FAST_WORKER, MODEL, RedisServer, free_port, serve
from worker.server import create_app as create_worker

PREFIX = "You answer questions about the tide tables of a small harbour town. " * 12


async def _start_worker(redis_url: str) -> tuple[str, web.AppRunner]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Long heartbeats: a flushed entry stays missing for the whole test.
    settings = dataclasses.replace(
        FAST_WORKER, port=port, store=redis_url, public_url=url, heartbeat_s=60.0,
        registry_ttl_s=120.0,
    )
    return url, await serve(create_worker(settings), port)


async def _start_gateway(redis_url: str, **overrides: Any) -> tuple[str, web.AppRunner]:
    port = free_port()
    settings = dataclasses.replace(
        GatewaySettings(port=port, store=redis_url, health_interval_s=0.2), **overrides
    )
    return f"http://127.0.0.1:{port}", await serve(create_gateway(settings), port)


async def _chat(http: aiohttp.ClientSession, gateway: str, user: str) -> dict[str, str]:
    async with http.post(gateway + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": user}],
    }) as response:
        assert response.status == 200, await response.text()
        return dict(response.headers)


async def _workers(http: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with http.get(gateway + "/admin/workers") as response:
        view: dict[str, Any] = await response.json()
    return view


async def _until(check: Any) -> None:
    for _ in range(200):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never held")


async def test_flushed_registry_keeps_healthy_workers_and_the_index(
    redis_server: RedisServer,
) -> None:
    runners: list[web.AppRunner] = []
    try:
        for _ in range(2):
            runners.append((await _start_worker(redis_server.url))[1])
        gateway, grunner = await _start_gateway(redis_server.url)
        runners.insert(0, grunner)
        sync = grunner.app[SYNC_KEY]
        async with aiohttp.ClientSession() as http:
            async def both_healthy() -> bool:
                view = await _workers(http, gateway)
                return sum(bool(w["healthy"]) for w in view["workers"]) == 2
            await _until(both_healthy)
            first = await _chat(http, gateway, "when is high tide?")
            blocks = (await _workers(http, gateway))["index_blocks"]
            assert blocks > 0

            client = aioredis.Redis.from_url(redis_server.url)
            await client.flushall()
            await client.aclose()
            await sync.sync_membership()  # the registry is empty now

            view = await _workers(http, gateway)
            assert sum(w["healthy"] for w in view["workers"]) == 2
            assert view["index_blocks"] == blocks
            again = await _chat(http, gateway, "and low tide?")
            assert again["x-route-worker"] == first["x-route-worker"]
            assert int(again["x-prefix-match-blocks"]) > 0

            # A worker that is missing from the registry AND fails its probes does leave.
            victim = next(r for r in runners[1:] if f"127.0.0.1:{r.addresses[0][1]}"
                          == first["x-route-worker"])
            await victim.cleanup()
            runners.remove(victim)

            async def victim_left() -> bool:
                await sync.sync_membership()
                view = await _workers(http, gateway)
                return first["x-route-worker"] not in {w["id"] for w in view["workers"]}
            await _until(victim_left)
            await _chat(http, gateway, "is the harbour open?")
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_starting_gateway_rebuilds_its_index_from_the_stream(
    redis_server: RedisServer,
) -> None:
    runners: list[web.AppRunner] = []
    try:
        port = free_port()
        worker_urls = []
        for _ in range(3):
            port = free_port()
            runners.append(await serve(create_worker(dataclasses.replace(FAST_WORKER, port=port)),
                                       port))
            worker_urls.append(f"http://127.0.0.1:{port}")
        a, arunner = await _start_gateway(redis_server.url, worker=tuple(worker_urls))
        runners.append(arunner)
        async with aiohttp.ClientSession() as http:
            routed = await _chat(http, a, "first question")
            client = aioredis.Redis.from_url(redis_server.url)

            async def published() -> bool:
                return bool(await client.xlen("affinity:assignments"))
            await _until(published)
            await client.aclose()

            # A gateway that starts now knows the prefix before it routes anything.
            b, brunner = await _start_gateway(redis_server.url, worker=tuple(worker_urls))
            runners.append(brunner)
            assert (await _workers(http, b))["index_blocks"] > 0
            learned = await _chat(http, b, "second question")
            assert learned["x-route-worker"] == routed["x-route-worker"]
            assert int(learned["x-prefix-match-blocks"]) > 0
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
