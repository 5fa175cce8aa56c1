"""Cache lifecycle: a model version change empties the index and the worker's cache; cache TTL.

Real reference workers and a gateway on 127.0.0.1, the official openai client for traffic.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import openai

from tests.conftest import FAST_WORKER, MODEL, StartCluster, free_port, serve
from worker.server import create_app as create_worker

SYSTEM = " ".join(f"Section {i}: refunds are issued within {i} days." for i in range(40))


async def ask(client: openai.AsyncOpenAI, question: str) -> dict[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return dict(raw.headers)


async def get(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return await r.json()


async def test_new_model_version_drops_index_and_cache_so_nothing_routes_on_stale_entries(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=2, health_interval_s=0.1, warmup_ramp_s=0.0)
    async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k",
                                  max_retries=0) as client:
        await ask(client, "first")
        seen = await ask(client, "second")
        assert seen["x-route-reason"].startswith("prefix_hit")
        holder = next(u for u in cluster.worker_urls if u.endswith(seen["x-route-worker"]))
        models = await get(holder + "/v1/models")
        assert models["data"][0]["revision"] == "sim"
        # Prompts are fingerprinted under the model and the version its workers report.
        view = await get(cluster.gateway_url + "/admin/workers")
        (version,) = {w["versions"][MODEL] for w in view["workers"]}
        assert version.startswith("sim")
        assert view["namespaces"] == {MODEL: f"{MODEL}@{version}"}

        async with aiohttp.ClientSession() as http, http.post(
                holder + "/admin/model", json={"revision": "v2"}) as r:
            assert r.status == 200

        async def noticed() -> bool:
            view = await get(cluster.gateway_url + "/admin/workers")
            w = next(w for w in view["workers"] if holder.endswith(w["id"]))
            return bool(w["versions"].get(MODEL, "").startswith("v2"))

        deadline = asyncio.get_running_loop().time() + 15
        while not await noticed():
            assert asyncio.get_running_loop().time() < deadline, "version change not seen"
            await asyncio.sleep(0.05)
        stats = await get(holder + "/stats")
        deadline = asyncio.get_running_loop().time() + 15
        while stats["cache"]["cached_blocks"]:  # the gateway flushes it
            assert asyncio.get_running_loop().time() < deadline, "cache not flushed"
            await asyncio.sleep(0.05)
            stats = await get(holder + "/stats")

        # After the change, no request is routed as a hit on what the old model held, and
        # every reply that the gateway called a hit really was one.
        replies = [await ask(client, f"after {i}") for i in range(6)]
    first = replies[0]
    assert not first["x-route-reason"].startswith("prefix_hit")
    for reply in replies:
        if reply["x-route-reason"].startswith("prefix_hit"):
            assert int(reply["x-cache-matched-tokens"]) > 0


async def test_worker_cache_ttl_drops_idle_prefixes() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runner = await serve(create_worker(dataclasses.replace(
        FAST_WORKER, port=port, cache_ttl_s=0.3)), port)
    try:
        body = {"model": MODEL, "max_tokens": 1, "prompt": SYSTEM}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
            async with http.post(url + "/v1/completions", json=body) as r:
                assert int(r.headers["x-cache-matched-tokens"]) > 0  # cached while fresh
            deadline = asyncio.get_running_loop().time() + 10
            while (await get(url + "/stats"))["cache"]["cached_blocks"]:
                assert asyncio.get_running_loop().time() < deadline, "TTL never expired"
                await asyncio.sleep(0.05)
            async with http.post(url + "/v1/completions", json=body) as r:
                assert int(r.headers["x-cache-matched-tokens"]) == 0
    finally:
        await runner.cleanup()
