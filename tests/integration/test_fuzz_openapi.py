"""schemathesis against a live gateway (reference workers behind it): no 5xx in 2,000+ cases."""

from __future__ import annotations

import aiohttp
import pytest

from loadtest.fuzz import fuzz, schemathesis_binary
from tests.conftest import MODEL, StartCluster


async def test_openapi_document_describes_the_api(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, api_key=("sk-x:x",))
    async with aiohttp.ClientSession() as http, http.get(
        cluster.gateway_url + "/openapi.json"
    ) as r:
        assert r.status == 200
        doc = await r.json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/workers"} <= set(
        doc["paths"])
    model = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model["enum"] == [MODEL]


async def test_schemathesis_finds_no_server_error() -> None:
    try:
        schemathesis_binary()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    result = await fuzz(2000, seed=7, timeout_s=1800)  # minutes on a busy shared machine
    assert result.returncode == 0, result.output_tail
    assert result.cases >= 2000, result.output_tail
    # About 2,000 in the fuzzing phase, spread over the operations with a body, and the
    # coverage phase's own: not 2,000 per operation.
    assert result.cases <= 4 * 2000, result.output_tail
    assert result.server_errors == 0, (result.statuses, result.worker_statuses)
    assert result.statuses.get("2xx", 0) > 0
    assert result.statuses.get("4xx", 0) > 100
    assert sum(result.worker_statuses.values()) > 100  # cases reached the workers too
