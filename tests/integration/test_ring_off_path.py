"""The ring is built off the requests' path: from the first health round before the first
request, and between requests after a change (``WorkerPool.defer``), never in a decision."""

from __future__ import annotations

import asyncio

import openai

from gateway.api import STATE
from tests.conftest import MODEL, StartCluster


async def test_the_ring_is_built_at_start_up_and_rebuilt_between_requests(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=2)
    pool = cluster.runners["gateway"].app[STATE].pool
    assert not pool.ring_stale  # built from the first health round's workers
    assert len(pool.ring.members) == 2
    joined = pool.add("http://127.0.0.1:9")  # a worker joins (unhealthy: never chosen)
    assert pool.ring_stale
    await asyncio.sleep(0)  # the rebuild runs on the loop, between requests
    assert not pool.ring_stale
    assert joined in pool.ring.members
    async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none",
                                  max_retries=0) as client:
        answer = await client.completions.create(model=MODEL, prompt="a ring", max_tokens=2)
    assert answer.choices[0].text
    assert not pool.ring_stale
