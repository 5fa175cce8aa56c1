"""Clients that go away: the gateway cancels the upstream request and the worker stops.

A worker with one running slot, so requests queue behind each other; every client here goes away
at a chosen point (waiting in the worker's queue, generating a non-streaming answer, mid-stream),
and the worker's own counters (``/metrics``) must show the request aborted and no more tokens
generated for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import Callable

import aiohttp

from tests.conftest import FAST_WORKER, MODEL, Cluster, StartCluster

ONE_SLOT = dataclasses.replace(FAST_WORKER, max_running=1)
LONG = 4000  # output tokens: far longer than any test waits (2 ms each)
_SAMPLE = re.compile(r'^([a-z_:]+)\{([^}]*)\}\s+([-+0-9.e]+)$', re.MULTILINE)


async def worker_metrics(url: str) -> dict[str, float]:
    """Samples of the worker's /metrics, keyed ``name`` or ``name{stage}``."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        stage = re.search(r'stage="([a-z]+)"', labels)
        out[f"{name}{{{stage.group(1)}}}" if stage else name] = float(value)
    return out


async def until(check: Callable[[dict[str, float]], bool], url: str) -> dict[str, float]:
    """Poll the worker's metrics until ``check`` holds (the test fails if it never does)."""
    for _ in range(200):
        metrics = await worker_metrics(url)
        if check(metrics):
            return metrics
        await asyncio.sleep(0.025)
    raise AssertionError(f"condition never held; last metrics: {metrics}")


async def hold(url: str, body: dict[str, object], *, chunks: int = 0) -> None:
    """Send ``body`` and read the answer (or ``chunks`` stream chunks, then wait); the caller
    cancels this task to make the client go away."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200
        for _ in range(chunks):
            await response.content.readany()
        await asyncio.Event().wait()


def chat(stream: bool, max_tokens: int = LONG) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me everything about caches"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def abort(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def inflight(cluster: Cluster) -> int:
    async with aiohttp.ClientSession() as session, session.get(
        cluster.gateway_url + "/admin/workers"
    ) as response:
        payload = await response.json()
    return sum(int(w["inflight_requests"]) for w in payload["workers"])


async def test_aborted_clients_stop_the_worker_in_every_state(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, worker_settings=ONE_SLOT)
    worker = cluster.worker_urls[0]
    url = cluster.gateway_url + "/v1/chat/completions"

    running = asyncio.create_task(hold(url, chat(stream=False)))
    await until(lambda m: m["vllm:num_requests_running"] == 1, worker)
    queued = [asyncio.create_task(hold(url, chat(stream=s))) for s in (False, True)]
    await until(lambda m: m["vllm:num_requests_waiting"] == 2, worker)

    # Two clients leave while their requests wait in the worker's queue.
    for task in queued:
        await abort(task)
    after = await until(lambda m: m.get("worker_requests_aborted_total{waiting}") == 2, worker)
    assert after["vllm:num_requests_waiting"] == 0

    # The non-streaming client leaves while its answer is being generated.
    await abort(running)
    stopped = await until(lambda m: m.get("worker_requests_aborted_total{running}") == 1, worker)
    assert stopped["vllm:num_requests_running"] == 0
    assert stopped["vllm:generation_tokens_total"] < LONG
    await asyncio.sleep(0.2)  # a window in which a still-running generation would add tokens
    later = await worker_metrics(worker)
    assert later["vllm:generation_tokens_total"] == stopped["vllm:generation_tokens_total"]
    assert await inflight(cluster) == 0


async def test_client_leaving_mid_stream_stops_generation(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, worker_settings=ONE_SLOT)
    worker = cluster.worker_urls[0]
    task = asyncio.create_task(
        hold(cluster.gateway_url + "/v1/chat/completions", chat(stream=True), chunks=3)
    )
    await until(lambda m: m["vllm:generation_tokens_total"] >= 10, worker)
    await abort(task)
    stopped = await until(lambda m: m.get("worker_requests_aborted_total{running}") == 1, worker)
    await asyncio.sleep(0.2)
    later = await worker_metrics(worker)
    assert later["vllm:generation_tokens_total"] == stopped["vllm:generation_tokens_total"] < LONG
    assert later["vllm:num_requests_running"] == 0
    assert await inflight(cluster) == 0

    # The worker and the gateway's pooled connection to it still serve the next request.
    async with aiohttp.ClientSession() as session, session.post(
        cluster.gateway_url + "/v1/chat/completions", json=chat(stream=False, max_tokens=3)
    ) as response:
        assert response.status == 200
        assert (await response.json())["usage"]["completion_tokens"] == 3
