"""``python -m infra local up|scale|down|status``: detached workers that register in Redis, and a
gateway on the same store that follows them without a restart."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from infra.local_detached import alive, load_state
from tests.conftest import MODEL, RedisServer, StartCluster


def infra(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra", "local", *argv], capture_output=True,
                          text=True, timeout=120)


async def gateway_workers(gateway_url: str, want: int) -> set[str]:
    """Worker ids the gateway lists, once it lists ``want`` healthy ones (5 s at most)."""
    ids: set[str] = set()
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            async with http.get(gateway_url + "/admin/workers") as r:
                view = await r.json()
            ids = {w["id"] for w in view["workers"] if w["healthy"]}
            if len(ids) == want:
                return ids
            await asyncio.sleep(0.05)
    return ids


async def test_up_scale_status_down(
    tmp_path: Path, redis_server: RedisServer, start_cluster: StartCluster
) -> None:
    run = str(tmp_path / "run")
    try:
        up = await asyncio.to_thread(infra, "up", "--workers", "2", "--store", redis_server.url,
                                     "--run-dir", run)
        assert up.returncode == 0, up.stderr
        state = load_state(Path(run))
        assert state is not None
        assert len(state.workers) == 2
        cluster = await start_cluster(workers=0, store=redis_server.url)
        first = await gateway_workers(cluster.gateway_url, 2)
        assert first == {w.url.removeprefix("http://") for w in state.workers}

        grown = await asyncio.to_thread(infra, "scale", "3", "--run-dir", run)
        assert grown.returncode == 0, grown.stderr
        assert len(await gateway_workers(cluster.gateway_url, 3)) == 3
        status = await asyncio.to_thread(infra, "status", "--run-dir", run)
        assert status.stdout.count("healthy") == 3, status.stdout

        shrunk = await asyncio.to_thread(infra, "scale", "1", "--run-dir", run)
        assert shrunk.returncode == 0, shrunk.stderr
        (left,) = await gateway_workers(cluster.gateway_url, 1)
        async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k",
                                      max_retries=0) as oa:
            raw = await oa.completions.with_raw_response.create(model=MODEL, prompt="hi",
                                                                max_tokens=1)
        assert raw.headers["x-route-worker"] == left
        again = await asyncio.to_thread(infra, "up", "--workers", "1", "--store",
                                        redis_server.url, "--run-dir", run)
        assert again.returncode == 1
        assert "local scale" in again.stderr
    finally:
        down = await asyncio.to_thread(infra, "down", "--run-dir", run)
    assert down.returncode == 0, down.stderr
    assert load_state(Path(run)) is None
    assert all(not alive(w.pid) for w in state.workers)


def test_scale_without_up_says_what_to_do(tmp_path: Path) -> None:
    result = infra("scale", "2", "--run-dir", str(tmp_path))
    assert result.returncode == 1
    assert "local up" in result.stderr


@pytest.mark.parametrize("action", ["down", "status"])
def test_down_and_status_with_nothing_running(tmp_path: Path, action: str) -> None:
    result = infra(action, "--run-dir", str(tmp_path))
    assert result.returncode == 0
