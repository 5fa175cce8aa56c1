"""Timeouts and ejection: hung workers, slow bodies, a full connection pool.

A hung worker is a real worker process stopped with SIGSTOP: the kernel still accepts its
connections, nothing answers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.settings import GatewaySettings
from tests.conftest import (
    MODEL,
    Processes,
    StartCluster,
    admin_workers,
    free_port,
    gateway_over,
    probed_by_hand,
    probed_engine,
    serve,
    stopped,
)


def _chat(user: str, max_tokens: int = 2) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": user}]}



@pytest.fixture
async def two_workers(processes: Processes) -> list[tuple[str, asyncio.subprocess.Process]]:
    return [await processes.worker() for _ in range(2)]


async def test_first_byte_timeout_reroutes_and_the_breaker_ejects_a_hung_worker(
    two_workers: list[tuple[str, asyncio.subprocess.Process]],
) -> None:
    (hung_url, hung), (ok_url, _) = two_workers
    hung_id = hung_url.removeprefix("http://")
    async with gateway_over(
        [hung_url, ok_url], first_byte_timeout_s=0.3, breaker_failures=2,
        breaker_cooldown_s=0.5, health_interval_s=3600.0,
    ) as gateway, aiohttp.ClientSession() as http:
        async with stopped(hung):
            replies = []
            for i in range(12):
                async with http.post(gateway + "/v1/chat/completions",
                                     json=_chat(f"question {i} " * (i + 1))) as r:
                    assert r.status == 200, await r.text()
                    replies.append(r.headers["x-route-worker"])
            assert set(replies) == {ok_url.removeprefix("http://")}
            view = await admin_workers(http, gateway)
            assert view[hung_id]["breaker"] in ("open", "half_open")

        # Back to life: once the cooldown ends, one trial request closes the breaker.
        for _ in range(100):
            await asyncio.sleep(0.1)
            for i in range(4):
                async with http.post(gateway + "/v1/chat/completions",
                                     json=_chat(f"later {i} " * (i + 1))) as r:
                    assert r.status == 200
            if (await admin_workers(http, gateway))[hung_id]["breaker"] == "closed":
                break
        else:
            raise AssertionError("the breaker never closed again")


async def test_worker_found_down_by_probes_loses_its_waiting_requests(
    two_workers: list[tuple[str, asyncio.subprocess.Process]],
) -> None:
    (hung_url, hung), _ = two_workers
    # No first-byte timeout: only the health probes can free the requests.
    async with gateway_over([hung_url], health_interval_s=0.2) as gateway, \
            aiohttp.ClientSession() as http, stopped(hung):
        response = await asyncio.wait_for(
            http.post(gateway + "/v1/chat/completions", json=_chat("hello")), 30
        )
        # The only worker hangs: the request fails (it does not wait for the read timeout).
        assert response.status in (502, 503)
        body = await response.json()
        assert body["error"]["type"] in ("upstream_error", "service_unavailable")
        response.release()


async def test_slow_request_body_gets_408_in_openai_shape(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, body_timeout_s=0.3)
    port = int(cluster.gateway_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 200\r\n\r\n{\"model\": "
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    payload = await reader.readexactly(length)
    writer.close()
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"


async def test_full_connection_pool_answers_503_with_retry_after(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        workers=1, max_connections_per_worker=1, queue_timeout_s=0.2, max_attempts=1
    )
    url = cluster.gateway_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        slow = asyncio.create_task(http.post(url, json=_chat("long one", max_tokens=400)))
        await asyncio.sleep(0.1)
        async with http.post(url, json=_chat("short one")) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "connection_queue_timeout"
        first = await slow
        assert first.status == 200
        first.release()
        async with http.post(url, json=_chat("short one")) as r:
            assert r.status == 200


async def test_a_request_waiting_for_a_connection_is_already_counted_on_its_worker(
    start_cluster: StartCluster,
) -> None:
    # The gateway writes a request to its worker before recording the decision, except when
    # the request must wait for a connection: then it is recorded first, so the decisions made
    # while it waits see it in flight on that worker.
    cluster = await start_cluster(workers=1, max_connections_per_worker=1, queue_timeout_s=10)
    url = cluster.gateway_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        slow = asyncio.create_task(http.post(url, json=_chat("long one", max_tokens=400)))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(http.post(url, json=_chat("short one")))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # in line for the one connection
        (worker,) = (await admin_workers(http, cluster.gateway_url)).values()
        assert worker["inflight_requests"] == 2
        for task in (slow, waiting):
            response = await task
            assert response.status == 200
            response.release()
        (worker,) = (await admin_workers(http, cluster.gateway_url)).values()
        assert worker["inflight_requests"] == 0


async def test_bad_timeout_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="body_timeout_s"):
        GatewaySettings(body_timeout_s=0)
    with pytest.raises(ValueError, match="first_byte_timeout_s"):
        GatewaySettings(first_byte_timeout_s=-1)



def _silent_streamer(release: asyncio.Event) -> web.Application:
    """A worker that answers probes and sends a stream's headers at once (as engines do),
    then nothing until ``release``."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await release.wait()
        return response

    return probed_engine({("POST", "/v1/chat/completions"): chat})


async def test_a_stream_with_headers_but_no_first_chunk_is_rerouted(
    processes: Processes,
) -> None:
    ok_url, _ = await processes.worker()
    port = free_port()
    release = asyncio.Event()
    silent = await serve(_silent_streamer(release), port)
    silent_url = f"http://127.0.0.1:{port}"
    try:
        async with gateway_over(
            [silent_url, ok_url], first_byte_timeout_s=0.3, health_interval_s=3600.0,
        ) as gateway, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            served = set()
            for i in range(6):
                body = {**_chat(f"stream {i} " * (i + 1)), "stream": True}
                async with http.post(gateway + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    text = (await r.read()).decode()
                    served.add(r.headers["x-route-worker"])
                assert "[DONE]" in text
                assert "error" not in text
            # Every stream came from the worker that sent chunks, the silent one's included.
            assert served == {ok_url.removeprefix("http://")}
            view = await admin_workers(http, gateway)
            assert view[silent_url.removeprefix("http://")]["breaker"] != "closed"
    finally:
        release.set()
        await silent.cleanup()


async def test_a_round_of_timed_out_probes_keeps_the_pool_and_two_in_a_row_empty_it(
    two_workers: list[tuple[str, asyncio.subprocess.Process]],
) -> None:
    """When every probe of a round times out, the gateway may be what stalled: the workers stay
    after one such round, leave after the second in a row, and come back with their first
    answered probe. A worker whose probe times out while another's is answered leaves at
    once."""
    (a_url, a), (b_url, b) = two_workers
    a_id, b_id = a_url.removeprefix("http://"), b_url.removeprefix("http://")
    async with probed_by_hand(a_url, b_url) as (pool, health):
        assert pool.healthy_ids() == {a_id, b_id}  # the start-up round
        async with stopped(a), stopped(b):
            await health.probe_all()
            assert pool.healthy_ids() == {a_id, b_id}
            await health.probe_all()
            assert pool.healthy_ids() == set()
        await health.probe_all()
        assert pool.healthy_ids() == {a_id, b_id}
        async with stopped(a):
            await health.probe_all()
            assert pool.healthy_ids() == {b_id}


def _odd_engine() -> web.Application:
    """An engine that answers its probes but whose metrics page carries samples that are not
    finite numbers and a cache size that overflows a float."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=(
            'vllm:num_requests_running{engine="0"} 3.0\n'
            'vllm:num_requests_running{engine="1"} NaN\n'
            "vllm:num_requests_waiting +Inf\n"
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e308"} 1.0\n'))

    return probed_engine({("GET", "/metrics"): metrics})


async def test_an_engine_with_odd_metrics_costs_no_other_worker_its_health_round(
    processes: Processes,
) -> None:
    """Its samples that are not finite are left out, and the round goes on to the workers
    after it: a worker found down comes back with its next answered probe. (The overflowing
    cache size once raised in the round, before the workers after it were updated.)"""
    odd_port = free_port()
    odd = await serve(_odd_engine(), odd_port)
    odd_url = f"http://127.0.0.1:{odd_port}"
    ok_url, ok = await processes.worker()
    odd_id, ok_id = odd_url.removeprefix("http://"), ok_url.removeprefix("http://")
    try:
        async with probed_by_hand(odd_url, ok_url) as (pool, health):
            assert pool.healthy_ids() == {odd_id, ok_id}
            assert pool.get(odd_id).engine_metrics == {"vllm:num_requests_running": 3.0,
                                                       "engine_ranks": 2.0}
            async with stopped(ok):
                await health.probe_all()  # the odd engine answered in time: a timeout is ok's
                assert pool.healthy_ids() == {odd_id}
            await health.probe_all()
            assert pool.healthy_ids() == {odd_id, ok_id}
    finally:
        await odd.cleanup()
