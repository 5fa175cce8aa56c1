"""The gateway in front of a reference worker of data-parallel ranks, over real HTTP on
127.0.0.1: each rank is a worker of its own, a prefix sticks to one rank, and the rank is named
to the worker in ``X-data-parallel-rank`` with the endpoint's credentials."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.backends.kinds import BackendOptions
from gateway.backends.openai_http import OPENAI
from gateway.routing.types import Worker
from tests.conftest import FAST_WORKER, admin_workers, free_port, gateway_over, serve, until
from worker.server import create_app as create_worker

RANKS = 3


@pytest.fixture
async def dp_worker() -> AsyncIterator[str]:
    port = free_port()
    settings = dataclasses.replace(FAST_WORKER, port=port, data_parallel_size=RANKS,
                                   cache_blocks=256)
    runner = await serve(create_worker(settings), port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _stats(http: aiohttp.ClientSession, worker: str) -> dict[str, Any]:
    async with http.get(worker + "/stats") as response:
        stats: dict[str, Any] = await response.json()
        return stats


async def _all_up(http: aiohttp.ClientSession, gateway: str, count: int) -> None:
    async def up() -> bool:
        workers = await admin_workers(http, gateway)
        return len(workers) == count and all(w["healthy"] for w in workers.values())

    await until(up)


async def test_each_rank_is_a_worker_and_a_prefix_keeps_to_one(dp_worker: str) -> None:
    endpoint = dp_worker.removeprefix("http://")
    async with gateway_over([dp_worker + f"#dp-size={RANKS}"]) as gateway, \
            aiohttp.ClientSession() as http:
        await _all_up(http, gateway, RANKS)
        workers = await admin_workers(http, gateway)
        assert sorted(workers) == [f"{endpoint}/dp{r}" for r in range(RANKS)]
        assert [workers[f"{endpoint}/dp{r}"]["rank"] for r in range(RANKS)] == [0, 1, 2]
        # Each rank's cache size came from its own engine's series on the shared /metrics.
        assert {w["capacity_blocks"] for w in workers.values()} == {256}
        client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused")
        ranks_seen: dict[int, set[str]] = {}
        routed = [0] * RANKS
        for i in range(12):
            system = f"Tenant {i}: " + "a system prompt that every request repeats. " * 12
            for turn in range(3):
                raw = await client.completions.with_raw_response.create(
                    model=FAST_WORKER.model, prompt=system + f"question {turn}", max_tokens=1)
                worker = raw.headers["x-route-worker"]
                ranks_seen.setdefault(i, set()).add(worker)
                routed[int(worker.removeprefix(f"{endpoint}/dp"))] += 1
        await client.close()
        # Every prefix stayed on one rank, and the prefixes spread over the ranks.
        assert all(len(seen) == 1 for seen in ranks_seen.values())
        assert len(set().union(*ranks_seen.values())) > 1
        # Each request ran on the rank the gateway chose: the worker's engines say so.
        stats = await _stats(http, dp_worker)
        assert [r["requests_finished"] for r in stats["ranks"]] == routed
        # Each prefix's second and third turns hit the rank that holds it.
        assert stats["cache"]["hit_tokens"] >= 12 * 2 * 100


async def test_the_ranks_use_the_endpoints_credentials(tmp_path: Path) -> None:
    port = free_port()
    settings = dataclasses.replace(FAST_WORKER, port=port, data_parallel_size=2,
                                   api_key="rank-secret")
    runner = await serve(create_worker(settings), port)
    key_file = tmp_path / "key"
    key_file.write_text("rank-secret\n")
    url = f"http://127.0.0.1:{port}?api_key_file={key_file}#dp-size=2"
    try:
        async with gateway_over([url]) as gateway, aiohttp.ClientSession() as http:
            await _all_up(http, gateway, 2)
            async with http.post(gateway + "/v1/completions", json={
                    "model": FAST_WORKER.model, "prompt": "hello", "max_tokens": 1}) as reply:
                assert reply.status == 200, await reply.text()
                assert reply.headers["x-route-worker"].startswith(f"127.0.0.1:{port}/dp")
    finally:
        await runner.cleanup()


async def test_a_server_listed_whole_is_one_worker_whose_ranks_its_balancer_picks(
    dp_worker: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.health"):
        async with gateway_over([dp_worker]) as gateway, aiohttp.ClientSession() as http:
            await _all_up(http, gateway, 1)
            workers = await admin_workers(http, gateway)
    (said,) = [r.getMessage() for r in caplog.records if "data-parallel" in r.getMessage()]
    assert f"serves {RANKS} data-parallel engines" in said
    assert f"'#dp-size={RANKS}'" in said
    assert [w["engine_metrics"]["engine_ranks"] for w in workers.values()] == [RANKS]
    assert [w["rank"] for w in workers.values()] == [None]
    # The whole server's cache: the sum over its ranks is not what one prefix can use, so the
    # gateway models one rank's (the first engine series on the page).
    assert [w["capacity_blocks"] for w in workers.values()] == [256]


async def test_the_ranks_of_a_server_share_one_probe_of_it() -> None:
    hits: dict[str, int] = {}

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        hits[request.path] = hits.get(request.path, 0) + 1
        response: web.StreamResponse = await handler(request)
        return response

    port = free_port()
    app = create_worker(dataclasses.replace(FAST_WORKER, port=port, data_parallel_size=RANKS))
    app.middlewares.append(count)
    runner = await serve(app, port)
    backend = OPENAI.build(BackendOptions(connect_timeout_s=2, read_timeout_s=5,
                                          max_connections=8, max_connections_per_worker=8))
    await backend.start()
    url = f"http://127.0.0.1:{port}"
    try:
        # Rank 1 has a request running: its series, and only its, say so.
        async with aiohttp.ClientSession() as http:
            body = {"model": FAST_WORKER.model, "prompt": "x " * 50, "max_tokens": 400,
                    "stream": True}
            async with http.post(url + "/v1/completions", json=body,
                                 headers={"X-data-parallel-rank": "1"}) as stream:
                assert stream.status == 200
                hits.clear()
                ranks = [Worker(f"127.0.0.1:{port}/dp{r}", url, rank=r) for r in range(RANKS)]
                probes = await asyncio.gather(*(backend.probe(w) for w in ranks))
        assert hits == {"/health": 1, "/v1/models": 1, "/metrics": 1}
        assert all(p.healthy and p.models == {FAST_WORKER.model} for p in probes)
        assert [p.metrics.get("vllm:num_requests_running") for p in probes] == [0.0, 1.0, 0.0]
        # Probes after that one ask again.
        await backend.probe(ranks[0])
        assert hits["/health"] == 2
    finally:
        await backend.close()
        await runner.cleanup()
