"""Warm-up on join: a worker registering mid-traffic is warmed before it takes its share.

Real redis-server, reference workers that register in it, a gateway on the store, the official
openai client for the traffic; everything over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.auth import TenantHasher
from gateway.settings import GatewaySettings
from infra.warming import follow
from tests.conftest import FAST_WORKER, MODEL, RedisServer, free_port, serve, until
from worker.server import create_app as create_worker

TENANT_KEYS = ("key-alpha", "key-bravo", "key-charlie")
TENANTS = ("alpha", "bravo", "charlie")
SECRET = "tenant-secret-for-tests"
ADMIN = {"x-admin-token": "admin-token-for-tests"}


def system_prompt(tenant: int) -> str:
    return " ".join(f"policy{tenant} clause{j} applies to every order." for j in range(60))


def messages(tenant: int, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt(tenant)},
            {"role": "user", "content": question}]


@dataclasses.dataclass
class Fleet:
    redis: RedisServer
    runners: list[web.AppRunner]  # the workers
    gateway: str = ""  # the last one started
    gateway_runners: list[web.AppRunner] = dataclasses.field(default_factory=list)

    async def close(self) -> None:
        for gateway in self.gateway_runners:  # the gateways first: they hold connections
            await gateway.cleanup()
        for runner in self.runners:
            await runner.cleanup()

    async def worker(self, **overrides: Any) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        settings = dataclasses.replace(
            FAST_WORKER, port=port, store=self.redis.url, public_url=url,
            heartbeat_s=0.2, registry_ttl_s=2.0, **overrides)
        self.runners.append(await serve(create_worker(settings), port))
        return url

    async def start_gateway(self, **overrides: Any) -> None:
        port = free_port()
        settings = dataclasses.replace(
            GatewaySettings(port=port, store=self.redis.url, health_interval_s=0.2,
                            warmup_ramp_s=0.2, tenant_secret=SECRET,
                            admin_token=ADMIN["x-admin-token"],
                            api_key=tuple(f"{k}:{t}" for k, t in zip(TENANT_KEYS, TENANTS,
                                                                     strict=True))),
            **overrides)
        self.gateway_runners.append(await serve(create_gateway(settings), port))
        self.gateway = f"http://127.0.0.1:{port}"

    async def workers(self, gateway: str = "") -> dict[str, dict[str, Any]]:
        async with aiohttp.ClientSession() as http, http.get(
                (gateway or self.gateway) + "/admin/workers", headers=ADMIN) as r:
            view: dict[str, Any] = await r.json()
        return {w["url"]: w for w in view["workers"]}


@pytest.fixture
async def fleet(redis_server: RedisServer) -> AsyncIterator[Fleet]:
    f = Fleet(redis_server, [])
    yield f
    await f.close()



async def traffic(gateway: str, rounds: int) -> None:
    clients = [openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=key, max_retries=0)
               for key in TENANT_KEYS]

    async def ask(t: int, i: int) -> None:
        reply = await clients[t].chat.completions.create(
            model=MODEL, max_tokens=2, messages=messages(t, f"question {i} of tenant {t}"))  # type: ignore[arg-type]
        assert reply.choices

    for i in range(rounds):
        await asyncio.gather(*(ask(t, i) for t in range(len(TENANT_KEYS))))
    for client in clients:
        await client.close()


def namespace_of(tenant: int) -> str:
    hasher = TenantHasher(SECRET.encode())
    return hasher.namespace(hasher.tenant_id(TENANTS[tenant]), "")


async def direct_hit(worker: str, tenant: int, key: str = "") -> int:
    """Matched tokens when the worker gets the tenant's prompt as the gateway forwards it."""
    headers = {"x-cache-namespace": namespace_of(tenant)}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as http, http.post(
        worker + "/v1/chat/completions", headers=headers,
        json={"model": MODEL, "max_tokens": 1, "messages": messages(tenant, "a new question")},
    ) as r:
        assert r.status == 200
        return int(r.headers["x-cache-matched-tokens"])


@pytest.mark.parametrize("warmup", [True, False])
async def test_a_joining_worker_is_warmed_with_the_sampled_prompts(
    fleet: Fleet, warmup: bool
) -> None:
    for _ in range(2):
        await fleet.worker()
    await fleet.start_gateway(warmup=warmup, warmup_sample=("*",))

    async def two_up() -> bool:
        return sum(bool(w["healthy"]) for w in (await fleet.workers()).values()) == 2

    await until(two_up)
    await traffic(fleet.gateway, rounds=10)  # 10 requests per system prompt: all hot

    new = await fleet.worker()

    async def settled() -> bool:
        w = (await fleet.workers()).get(new)
        if w is None or not w["healthy"]:
            return False
        return not warmup or w["state"] == "serving"

    if warmup:  # what `infra local scale --gateway URL` prints
        lines: list[str] = []
        new_id = new.removeprefix("http://")
        assert await follow(fleet.gateway, [new_id], timeout_s=20, interval_s=0.05,
                            token=ADMIN["x-admin-token"], out=lines.append)
        assert lines[-1] == f"{new_id}: serving (warmed 3/3 prompts, " + lines[-1].split(
            ", ", 1)[1]
    await until(settled)
    seen = (await fleet.workers())[new]
    if warmup:
        report = seen["warmup"]
        assert report["phase"] == "ready"
        assert report["reason"] == "joined"
        assert report["done_prompts"] == len(TENANT_KEYS)
        assert report["failed_prompts"] == 0
        assert seen["modelled_blocks"] > 0
        # The replay used the normalized text and the tenant's namespace: the worker's own
        # cache answers the tenant's next request from the warmed prefix.
        for t in range(len(TENANT_KEYS)):
            assert await direct_hit(new, t) > 0
    else:
        assert seen["warmup"] is None
        assert all([await direct_hit(new, t) == 0 for t in range(len(TENANT_KEYS))])
    await traffic(fleet.gateway, rounds=2)  # everyone still served


async def test_the_sample_is_off_by_default_so_nothing_is_replayed(fleet: Fleet) -> None:
    await fleet.worker()
    await fleet.start_gateway()

    async def one_up() -> bool:
        return any(w["healthy"] for w in (await fleet.workers()).values())

    await until(one_up)
    await traffic(fleet.gateway, rounds=9)
    new = await fleet.worker()

    async def ready() -> bool:
        w = (await fleet.workers()).get(new)
        return w is not None and w["warmup"] is not None and w["warmup"]["phase"] == "ready"

    await until(ready)
    report = (await fleet.workers())[new]["warmup"]
    assert report["planned_prompts"] == 0
    assert await direct_hit(new, 0) == 0


async def worker_stats(worker: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(worker + "/stats") as r:
        stats: dict[str, Any] = await r.json()
    return stats


async def test_gateways_sharing_a_store_warm_a_joining_worker_once(fleet: Fleet) -> None:
    for _ in range(2):
        await fleet.worker()
    gateways = []
    for _ in range(2):  # two replicas on one Redis, as `--procs 2` or two hosts run them
        await fleet.start_gateway(warmup_sample=("*",))
        gateways.append(fleet.gateway)

    async def two_up() -> bool:
        views = [await fleet.workers(g) for g in gateways]
        return all(sum(bool(w["healthy"]) for w in v.values()) == 2 for v in views)

    await until(two_up)
    for gateway in gateways:  # each replica samples what it routes
        await traffic(gateway, rounds=10)
    new = await fleet.worker()

    async def serving_everywhere() -> bool:
        for gateway in gateways:
            w = (await fleet.workers(gateway)).get(new)
            if w is None or w["state"] != "serving" or w["warmup"] is None:
                return False
        return True

    await until(serving_everywhere)
    reports = [(await fleet.workers(g))[new]["warmup"] for g in gateways]
    warmers = {r["warmed_by"] for r in reports}
    assert len(warmers) == 1  # both name the same gateway
    assert "" not in warmers
    assert sorted(r["done_prompts"] for r in reports) == [0, len(TENANT_KEYS)]
    # The worker got each sampled prompt once, not once per gateway.
    assert (await worker_stats(new))["requests_admitted"] == len(TENANT_KEYS)
    for t in range(len(TENANT_KEYS)):
        assert await direct_hit(new, t) > 0


async def hot_prompts(worker: str, key: str = "", query: str = "") -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.get(
            worker + "/admin/hot-prompts" + query, headers=headers) as r:
        return r.status, await r.json()


async def test_a_joining_worker_is_warmed_from_its_peers_hottest_prompts(fleet: Fleet) -> None:
    key = "worker-key-for-tests"  # the workers' secret: their /admin/* answer only with it
    for _ in range(2):
        await fleet.worker(api_key=key)
    await fleet.start_gateway(worker_api_key=key)  # the gateway's own sample stays off

    async def two_up() -> bool:
        return sum(bool(w["healthy"]) for w in (await fleet.workers()).values()) == 2

    await until(two_up)
    await traffic(fleet.gateway, rounds=10)
    serving = list(await fleet.workers())
    status, body = await hot_prompts(serving[0])
    assert status == 401  # no secret, no prompt text
    assert "policy" not in str(body)
    # A limit in digits of another script (a superscript two) is a 400, not the worker's 500.
    for query in ("?limit=%C2%B2", "?limit=0", "?limit=x"):
        status, body = await hot_prompts(serving[0], key, query)
        assert (status, body["error"]["param"]) == (400, "limit")
    exported = [e for w in serving for e in (await hot_prompts(w, key))[1]["data"]]
    assert {e["namespace"] for e in exported} == {namespace_of(t) for t in range(3)}
    assert all(e["uses"] >= 1 for e in exported)

    new = await fleet.worker(api_key=key)

    async def ready() -> bool:
        w = (await fleet.workers()).get(new)
        return w is not None and w["warmup"] is not None and w["warmup"]["phase"] == "ready"

    await until(ready)
    report = (await fleet.workers())[new]["warmup"]
    assert report["peer_prompts"] == len(exported)
    assert report["done_prompts"] >= len(TENANT_KEYS)
    assert report["failed_prompts"] == 0
    for t in range(len(TENANT_KEYS)):
        assert await direct_hit(new, t, key) > 0
    await traffic(fleet.gateway, rounds=1)


async def test_a_worker_without_an_admin_secret_exports_nothing(fleet: Fleet) -> None:
    worker = await fleet.worker()
    status, body = await hot_prompts(worker)
    assert status == 403
    assert body["error"]["code"] == "forbidden"
