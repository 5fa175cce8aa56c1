"""A holder whose engine has every slot taken spreads its prefix, though no prefill queues.

Two reference workers over real HTTP that run one request at a time and decode slowly. Every
request shares one long system prompt, so each one is a cache hit on the worker that holds it:
no uncached prefill ever queues, and with two workers the load guard (3 x the mean) can never
divert from the holder. What shows the queue is the engine's own report: requests waiting for
admission, which the gateway reads from the worker's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import aiohttp

from tests.conftest import FAST_WORKER, MODEL, StartCluster

SYSTEM = "You are the route planner of a regional railway; answer with timetables. " * 40
ONE_SLOT = dataclasses.replace(FAST_WORKER, max_running=1, decode_ms_per_token=40.0)


async def _chat(http: aiohttp.ClientSession, gateway: str, question: str) -> tuple[int, str]:
    body = {"model": MODEL, "max_tokens": 6, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}
    async with http.post(gateway + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-route-worker", "")


async def test_requests_waiting_in_the_holders_engine_spread_its_prefix(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=2, worker_settings=ONE_SLOT, health_interval_s=0.1,
                                  prewarm=False)
    url = cluster.gateway_url
    async with aiohttp.ClientSession() as http:
        status, holder = await _chat(http, url, "first question")
        assert status == 200

        async def later(i: int) -> tuple[int, str]:
            await asyncio.sleep(0.05 * i)  # a steady stream: the holder's queue builds up
            return await _chat(http, url, f"question {i} about the night trains")

        results = await asyncio.gather(*(later(i) for i in range(16)))
    assert all(status == 200 for status, _ in results)
    served = collections.Counter(worker for _, worker in results)
    assert len(served) == 2, served  # the other worker took part of the prefix's traffic
    assert served[holder] >= 1  # ... and the holder kept serving it


async def test_each_prewarm_is_named_on_the_answer_to_the_request_that_placed_it(
    start_cluster: StartCluster,
) -> None:
    # The same queue with pre-warming on, from the first excess wait on the holder (a low
    # fraction of what a move adds): a decision that keeps the prefix on its holder
    # pre-warms it on the other worker, and its answer says where (what a replay of the run
    # needs to place the same pre-warms in the simulator).
    cluster = await start_cluster(workers=2, worker_settings=ONE_SLOT, health_interval_s=0.1,
                                  prewarm_fraction=0.01)
    url = cluster.gateway_url
    prewarmed: list[tuple[str, str]] = []  # (worker that answered, worker pre-warmed on)

    async def chat(question: str) -> str:
        body = {"model": MODEL, "max_tokens": 6, "stream": True,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": question}]}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            assert r.status == 200
            if "x-route-prewarm" in r.headers:
                prewarmed.append((r.headers["x-route-worker"], r.headers["x-route-prewarm"]))
            return r.headers["x-route-worker"]

    async with aiohttp.ClientSession() as http:
        holder = await chat("first question")

        async def later(i: int) -> str:
            await asyncio.sleep(0.05 * i)
            return await chat(f"question {i} about the night trains")

        await asyncio.gather(*(later(i) for i in range(16)))
        async with http.get(url + "/admin/workers") as r:
            stats = (await r.json())["prewarm"]
    assert prewarmed, f"no answer named a pre-warm ({stats})"
    assert len(prewarmed) == stats["sent"]  # every pre-warm, on the answer that placed it
    for answered, target in prewarmed:
        assert answered == holder
        assert target != holder
