"""With a real redis-server: tenant ids are keyed hashes there, and a registry entry cannot
buy traffic with a claimed cache size its worker does not confirm."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import xxhash

from gateway.app import create_app as create_gateway
from gateway.contracts.registry_signing import signed, verified
from gateway.settings import GatewaySettings
from gateway.store.base import WorkerRecord
from gateway.store.redis import RedisStore
from tests.conftest import FAST_WORKER, MODEL, RedisServer, free_port, serve
from worker.server import create_app as create_worker

SECRET = "tenant-secret-for-tests"


async def _until(predicate: Callable[[], Any], timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.1)


async def test_tenant_ids_in_redis_are_keyed_hashes(redis_server: RedisServer) -> None:
    wport, gport = free_port(), free_port()
    worker = await serve(create_worker(dataclasses.replace(FAST_WORKER, port=wport)), wport)
    settings = GatewaySettings(
        port=gport, worker=(f"http://127.0.0.1:{wport}",), store=redis_server.url,
        api_key=("sk-acme-secret:acme", "sk-globex-secret:globex"), tenant_secret=SECRET,
    )
    gateway = await serve(create_gateway(settings), gport)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async with aiohttp.ClientSession() as http:
            for key in ("sk-acme-secret", "sk-globex-secret"):
                async with http.post(
                    f"http://127.0.0.1:{gport}/v1/completions",
                    json={"model": MODEL, "prompt": "hello " * 40, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp:
                    assert resp.status == 200

        async def tenants() -> list[str]:
            return [k.decode() async for k in r.scan_iter(match="affinity:telemetry:tenant:*")]

        await _until(lambda: _len_at_least(tenants, 2))
        names = sorted(k.rsplit(":", 1)[1] for k in await tenants())
        expected = sorted(
            hmac.new(SECRET.encode(), b"tenant\x00" + t, hashlib.sha256).hexdigest()[:24]
            for t in (b"acme", b"globex")
        )
        assert names == expected
        everything = b" ".join([k async for k in r.scan_iter(match="*")])
        for leaked in (b"acme", b"globex", b"sk-acme-secret",
                       xxhash.xxh3_64_hexdigest(b"sk-acme-secret").encode()):
            assert leaked not in everything
    finally:
        await r.aclose()
        await gateway.cleanup()
        await worker.cleanup()


async def _len_at_least(fn: Callable[[], Any], n: int) -> bool:
    return len(await fn()) >= n


async def test_claimed_capacity_is_capped_by_the_workers_own_probe(
    redis_server: RedisServer,
) -> None:
    runners = []
    ids = []
    for _ in range(3):
        port = free_port()
        worker_settings = dataclasses.replace(FAST_WORKER, port=port)
        runners.append(await serve(create_worker(worker_settings), port))
        ids.append(f"127.0.0.1:{port}")
    store = RedisStore(redis_server.url)
    await store.start()
    # Two honest registrations, and one claiming a cache a million times the size of its
    # worker's: only write access to Redis is needed for that.
    for i, wid in enumerate(ids):
        await store.register_worker(WorkerRecord(
            id=wid, url=f"http://{wid}", models=(MODEL,), block_size=16,
            capacity_blocks=2048 * (1_000_000 if i == 2 else 1),
        ), ttl_s=60)
    gport = free_port()
    gateway = await serve(create_gateway(GatewaySettings(
        port=gport, store=redis_server.url, health_interval_s=0.2)), gport)
    base = f"http://127.0.0.1:{gport}"
    try:
        async with aiohttp.ClientSession() as http:
            async def weights() -> dict[str, Any]:
                async with http.get(base + "/admin/rebalance") as resp:
                    workers: dict[str, Any] = (await resp.json())["workers"]
                    return workers

            async def confirmed() -> bool:
                view = await weights()
                return len(view) == 3 and all(w["capacity_blocks"] > 0 for w in view.values())

            await _until(confirmed)
            await asyncio.sleep(1.5)  # a membership round after the probes
            view = await weights()
            assert {wid: w["weight"] for wid, w in view.items()} == {wid: 1.0 for wid in ids}
            routed: dict[str, int] = {}
            for i in range(24):
                async with http.post(base + "/v1/completions", json={
                    "model": MODEL, "prompt": f"cold prompt {i} " * 20, "max_tokens": 1,
                }) as resp:
                    assert resp.status == 200
                    worker = resp.headers["x-route-worker"]
                    routed[worker] = routed.get(worker, 0) + 1
        assert routed.get(ids[2], 0) < 24 * 0.75
    finally:
        await store.close()
        await gateway.cleanup()
        for runner in runners:
            await runner.cleanup()


async def test_unsigned_registrations_are_ignored_with_a_registry_secret(
    redis_server: RedisServer,
) -> None:
    registry_secret = "registration-secret-for-tests"
    hport, iport = free_port(), free_port()
    honest_id, impostor_id = f"127.0.0.1:{hport}", f"127.0.0.1:{iport}"
    # The honest worker registers itself, signed; the impostor is a working server too, but
    # only a Redis writer vouches for it.
    honest = await serve(create_worker(dataclasses.replace(
        FAST_WORKER, port=hport, store=redis_server.url, public_url=f"http://{honest_id}",
        registry_secret=registry_secret, heartbeat_s=0.2, registry_ttl_s=5.0,
    )), hport)
    impostor = await serve(create_worker(dataclasses.replace(FAST_WORKER, port=iport)), iport)
    store = RedisStore(redis_server.url)
    await store.start()
    impostor_record = WorkerRecord(id=impostor_id, url=f"http://{impostor_id}", models=(MODEL,))
    await store.register_worker(impostor_record, ttl_s=60)
    forged = signed(dataclasses.replace(impostor_record, id="127.0.0.1:1"), b"a guess")
    await store.register_worker(forged, ttl_s=60)
    signing, open_ = free_port(), free_port()
    gateways = [
        await serve(create_gateway(GatewaySettings(
            port=port, store=redis_server.url, health_interval_s=0.2, registry_secret=secret,
        )), port)
        for port, secret in ((signing, registry_secret), (open_, ""))
    ]
    try:
        async with aiohttp.ClientSession() as http:
            async def pool(port: int) -> set[str]:
                async with http.get(f"http://127.0.0.1:{port}/admin/workers") as resp:
                    return {w["id"] for w in (await resp.json())["workers"] if w["healthy"]}

            async def both_seen() -> bool:
                # The gateway without the secret believes every entry: the impostor is live.
                return {honest_id, impostor_id} <= await pool(open_)

            await _until(both_seen)
            await _until(lambda: _contains(pool(signing), honest_id))
            await asyncio.sleep(1.0)  # more membership rounds
            assert await pool(signing) == {honest_id}
            for i in range(12):
                async with http.post(f"http://127.0.0.1:{signing}/v1/completions", json={
                    "model": MODEL, "prompt": f"cold prompt {i} " * 20, "max_tokens": 1,
                }) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-route-worker"] == honest_id
    finally:
        await store.close()
        for runner in (*gateways, honest, impostor):
            await runner.cleanup()


async def _contains(values: Any, item: str) -> bool:
    return item in await values


async def test_a_registered_server_of_ranks_is_a_worker_per_rank(
    redis_server: RedisServer,
) -> None:
    """A worker of 2 data-parallel ranks registers once, signed, with ``dp_size`` 2: the
    gateway routes to each rank, and a record whose ``dp_size`` a Redis writer changed no
    longer verifies."""
    secret = "registration-secret-for-ranks"
    port, gport = free_port(), free_port()
    wid = f"127.0.0.1:{port}"
    worker = await serve(create_worker(dataclasses.replace(
        FAST_WORKER, port=port, store=redis_server.url, public_url=f"http://{wid}",
        registry_secret=secret, heartbeat_s=0.2, registry_ttl_s=5.0, data_parallel_size=2,
    )), port)
    gateway = await serve(create_gateway(GatewaySettings(
        port=gport, store=redis_server.url, health_interval_s=0.2, registry_secret=secret,
    )), gport)
    store = RedisStore(redis_server.url)
    await store.start()
    try:
        async with aiohttp.ClientSession() as http:
            async def healthy() -> dict[str, Any]:
                async with http.get(f"http://127.0.0.1:{gport}/admin/workers") as resp:
                    return {w["id"]: w for w in (await resp.json())["workers"] if w["healthy"]}

            async def both_ranks() -> bool:
                return set(await healthy()) == {f"{wid}/dp0", f"{wid}/dp1"}

            await _until(both_ranks)
            ranks = await healthy()
            assert {w["source"] for w in ranks.values()} == {"registry"}
            assert [ranks[f"{wid}/dp{r}"]["rank"] for r in (0, 1)] == [0, 1]
            seen = set()
            for i in range(16):
                async with http.post(f"http://127.0.0.1:{gport}/v1/completions", json={
                    "model": MODEL, "prompt": f"cold prompt {i} " * 20, "max_tokens": 1,
                }) as resp:
                    assert resp.status == 200
                    seen.add(resp.headers["x-route-worker"])
            assert seen == {f"{wid}/dp0", f"{wid}/dp1"}
        (record,) = [r for r in await store.list_workers() if r.id == wid]
        assert record.dp_size == 2
        assert verified(record, secret.encode())
        assert not verified(dataclasses.replace(record, dp_size=4), secret.encode())
    finally:
        await store.close()
        for runner in (gateway, worker):
            await runner.cleanup()
