"""Many gateway replicas on one Redis: real redis-server, workers and gateways as processes."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.conftest import MODEL, Processes, RedisServer, free_port

PREFIX = (
    "You are the travel desk of a rail company. Quote fares from the tariff, never invent a "
    "timetable, and answer in the customer's language. "
) * 12
MARKER = "ZEBRA-MARKER-7731"

# Short heartbeats so registry expiry is observable within a test.
FAST_REGISTRY = ("--heartbeat-s", "0.3", "--registry-ttl-s", "1.5")


async def _chat(http: aiohttp.ClientSession, gateway: str, user: str,
                max_tokens: int = 2) -> tuple[int, dict[str, str]]:
    async with http.post(gateway + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": user}],
    }) as r:
        await r.read()
        return r.status, dict(r.headers)


async def _workers_seen(http: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with http.get(gateway + "/admin/workers") as r:
        view: dict[str, Any] = await r.json()
    return {w["id"]: w for w in view["workers"] if w["healthy"]}


async def _until(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


async def _cluster(processes: Processes, redis: RedisServer, workers: int = 4,
                   gateways: int = 2, worker_args: tuple[str, ...] = ()) -> tuple[
                       list[str], list[str]]:
    worker_urls = [
        (await processes.worker(*FAST_REGISTRY, *worker_args, store=redis.url))[0]
        for _ in range(workers)
    ]
    gateway_urls = [await processes.gateway("--store", redis.url) for _ in range(gateways)]
    async with aiohttp.ClientSession() as http:
        for g in gateway_urls:
            async def all_seen(g: str = g) -> bool:
                return len(await _workers_seen(http, g)) == workers
            await _until(all_seen)
    return worker_urls, gateway_urls


async def test_two_replicas_send_one_prefix_to_one_worker_and_share_the_index(
    processes: Processes, redis_server: RedisServer
) -> None:
    _, (a, b) = await _cluster(processes, redis_server)
    workers: list[str] = []
    b_matches: list[int] = []
    async with aiohttp.ClientSession() as http:
        for i in range(50):
            gateway = a if i % 2 == 0 else b
            status, headers = await _chat(http, gateway, f"question {i}")
            assert status == 200
            workers.append(headers["x-route-worker"])
            if gateway == b:
                b_matches.append(int(headers["x-prefix-match-blocks"]))
            if i == 0:
                # B has routed nothing yet; its index fills from A's assignments in Redis.
                async def b_learned() -> bool:
                    async with http.get(b + "/admin/rebalance") as r:
                        view = await r.json()
                    return any(w["held_blocks"] for w in view["workers"].values())
                await _until(b_learned, timeout_s=10)
    assert len(set(workers)) == 1
    # B never routed this prefix before its first request: it knows it from A, via Redis.
    assert b_matches[0] > 0
    assert all(m > 0 for m in b_matches)


async def test_hot_prefix_spreads_over_holders_within_the_bound(
    processes: Processes, redis_server: RedisServer
) -> None:
    _, (a, b) = await _cluster(processes, redis_server)
    results: list[tuple[int, dict[str, str]]] = []
    async with aiohttp.ClientSession() as http:
        await _chat(http, a, "warm up")
        results = await asyncio.gather(*(
            _chat(http, a if i % 2 else b, f"user {i} asks about fares", max_tokens=40)
            for i in range(64)
        ))
    holders = collections.Counter(h["x-route-worker"] for _, h in results)
    assert all(status == 200 for status, _ in results)
    assert len(holders) > 1, holders
    for _, headers in results:
        load = dict(part.split("=") for part in headers["x-route-load"].split(";"))
        assert int(load["tokens"]) <= int(load["bound"]), headers["x-route-load"]


async def test_killed_worker_leaves_routing_and_no_request_fails(
    processes: Processes, redis_server: RedisServer
) -> None:
    worker_urls, (a,) = await _cluster(processes, redis_server, gateways=1)
    victim = processes.procs[0]
    victim_id = worker_urls[0].removeprefix("http://")
    statuses: list[int] = []
    async with aiohttp.ClientSession() as http:
        async def traffic(n: int) -> None:
            for i in range(n):
                status, _ = await _chat(http, a, f"traffic {i} " * (1 + i % 5))
                statuses.append(status)

        load = asyncio.create_task(traffic(60))
        await asyncio.sleep(0.2)
        os.kill(victim.pid, signal.SIGKILL)
        await load

        async def left_the_pool() -> bool:
            # Not merely marked unhealthy: its registry entry expired and it left the pool.
            async with http.get(a + "/admin/workers") as r:
                return victim_id not in {w["id"] for w in (await r.json())["workers"]}
        await _until(left_the_pool, timeout_s=10)
    assert statuses == [200] * 60


async def test_redis_outage_keeps_serving_and_sharing_resumes(
    processes: Processes, redis_server: RedisServer
) -> None:
    _, (a, b) = await _cluster(processes, redis_server)
    async with aiohttp.ClientSession() as http:
        redis_server.stop()
        during = [await _chat(http, a if i % 2 else b, f"outage {i}") for i in range(20)]
        async with http.get(a + "/admin/rebalance") as r:
            assert (await r.json())["store_available"] is False
        redis_server.start()

        async def reachable() -> bool:
            async with http.get(b + "/admin/rebalance") as r:
                return bool((await r.json())["store_available"])
        await _until(reachable)
        # Sharing works again: a prefix only A has routed is known to B.
        fresh = "after the outage " * 40

        async def b_learns() -> bool:
            await _chat(http, a, fresh)
            await asyncio.sleep(0.2)
            _, headers = await _chat(http, b, fresh)
            # Right after the restart B may still be re-learning its workers (no route headers).
            return int(headers.get("x-prefix-match-blocks", "0")) > 0
        await _until(b_learns)
    assert [status for status, _ in during] == [200] * 20


async def _dump_everything(client: aioredis.Redis) -> bytes:
    """Every key and value in the database, as raw bytes."""
    r: Any = client  # redis-py's reply types are unions of bytes and str; these are bytes
    dump = bytearray()
    keys = [k async for k in r.scan_iter(count=1000)]
    assert keys, "nothing was shared at all"
    for key in keys:
        dump += key
        kind = (await r.type(key)).decode()
        if kind == "string":
            dump += await r.get(key) or b""
        elif kind == "hash":
            for f, v in (await r.hgetall(key)).items():
                dump += f + v
        elif kind == "list":
            dump += b"".join(await r.lrange(key, 0, -1))
        elif kind == "zset":
            dump += b"".join(await r.zrange(key, 0, -1))
        elif kind == "stream":
            for _, fields in await r.xrange(key):
                for f, v in fields.items():
                    dump += f + v
    return bytes(dump)


async def test_redis_holds_no_prompt_text(
    processes: Processes, redis_server: RedisServer
) -> None:
    _, (a, b) = await _cluster(processes, redis_server)
    async with aiohttp.ClientSession() as http:
        for i in range(10):
            await _chat(http, a if i % 2 else b, f"{MARKER} secret question {i}")
        await asyncio.sleep(1.5)  # let telemetry and assignments flush
    client = aioredis.Redis.from_url(redis_server.url)
    dump = await _dump_everything(client)
    await client.aclose()
    assert MARKER.encode() not in dump
    assert b"secret question" not in dump
    assert b"travel desk" not in dump


async def test_worker_with_twice_the_cache_gets_about_twice_the_share(
    processes: Processes, redis_server: RedisServer
) -> None:
    small = [(await processes.worker(*FAST_REGISTRY, "--cache-blocks", "1024",
                                     store=redis_server.url))[0] for _ in range(3)]
    big, _ = await processes.worker(*FAST_REGISTRY, "--cache-blocks", "2048",
                                    store=redis_server.url)
    gateway = await processes.gateway("--store", redis_server.url)
    routed: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession() as http:
        async def sizes_applied() -> bool:
            # Ring weights follow capacities once probes confirm them (the same sync step sets
            # both): wait for that, not just for the four workers, or a slow first probe round
            # routes the whole run on equal weights.
            seen = await _workers_seen(http, gateway)
            sizes = {wid: w["capacity_blocks"] for wid, w in seen.items()}
            big_size = sizes.get(big.removeprefix("http://"), 0)
            return len(seen) == 4 and min(sizes.values()) > 0 and all(
                big_size > 1.5 * size for wid, size in sizes.items()
                if wid != big.removeprefix("http://"))
        await _until(sizes_applied)
        for i in range(400):
            async with http.post(gateway + "/v1/completions", json={
                "model": MODEL, "prompt": f"document {i}: " + "lorem ipsum " * 30,
                "max_tokens": 1,
            }) as r:
                assert r.status == 200
                routed[r.headers["x-route-worker"]] += 1
    mean_small = sum(routed[u.removeprefix("http://")] for u in small) / 3
    ratio = routed[big.removeprefix("http://")] / mean_small
    assert 1.4 <= ratio <= 2.8, (ratio, routed)


@pytest.mark.parametrize("policy", ["cache_aware", "prefix_affinity"])
async def test_static_workers_still_work_with_redis(
    processes: Processes, redis_server: RedisServer, policy: str
) -> None:
    url, _ = await processes.worker()
    gateway = await processes.gateway("--store", redis_server.url, "--worker", url,
                                      "--policy", policy)
    async with aiohttp.ClientSession() as http:
        status, headers = await _chat(http, gateway, "hello")
    assert status == 200
    assert headers["x-route-policy"] == policy


async def test_gateway_starts_and_serves_with_redis_down(processes: Processes) -> None:
    url, _ = await processes.worker()
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    gateway = await processes.gateway("--store", nowhere, "--worker", url)
    async with aiohttp.ClientSession() as http:
        statuses = [(await _chat(http, gateway, f"no redis {i}"))[0] for i in range(10)]
        async with http.get(gateway + "/admin/rebalance") as r:
            view = await r.json()
    assert statuses == [200] * 10
    assert view["store_available"] is False


async def test_an_assignment_entry_the_gateway_cannot_read_is_counted_and_passed_over(
    processes: Processes, redis_server: RedisServer
) -> None:
    """One malformed entry in the store's stream (another version's fields) is skipped: the
    gateway counts it in /metrics and goes on taking in the entries after it."""
    url, _ = await processes.worker()
    gateway = await processes.gateway("--store", redis_server.url, "--worker", url)
    raw = aioredis.from_url(redis_server.url)
    try:
        await raw.xadd("affinity:assignments", {"origin": "elsewhere", "worker": "w9"})

        async def counted() -> bool:
            async with aiohttp.ClientSession() as http, http.get(gateway + "/metrics") as r:
                text = await r.text()
            return "gateway_store_unreadable_entries_total 1.0" in text

        await _until(counted)
        async with aiohttp.ClientSession() as http:
            status, _ = await _chat(http, gateway, "still answering")
        assert status == 200
    finally:
        await raw.aclose()
