"""The stored-conversation benchmark's client, against the real gateway and reference workers."""

from __future__ import annotations

import aiohttp

from loadtest.bench_stored import StoredConfig, run_router, to_markdown
from tests.conftest import StartCluster


async def test_it_counts_next_turns_cached_tokens_and_retrievals(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2)
    config = StoredConfig(workers=2, conversations=3, turns=3, concurrency=2)
    async with aiohttp.ClientSession() as http:
        result = await run_router(http, "ours", cluster.gateway_url, config)
    assert (result.next_turns, result.answered, result.finished) == (6, 6, 3)
    assert (result.retrieved, result.last_ids, result.failures) == (3, 3, {})
    assert 0 < result.cached_tokens < result.input_tokens
    assert len(result.latencies_ms) == 6
    assert "| ours | 6/6 (1.000) | 3/3 | none |" in to_markdown(config, "cmd", [result], {})
