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
