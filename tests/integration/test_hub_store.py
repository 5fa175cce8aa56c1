"""The hub that the processes of one gateway share, over a real Unix socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.store.base import Assignment, CacheReport, StoreUnavailable, WorkerRecord
from gateway.store.hub import HubServer, HubStore


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[HubServer]:
    server = HubServer(str(tmp_path / "hub.sock"))
    await server.start()
    yield server
    await server.close()


async def _client(hub: HubServer) -> HubStore:
    store = HubStore(hub.url)
    await store.start()
    return store


async def test_assignments_reach_the_other_process(hub: HubServer) -> None:
    a, b = await _client(hub), await _client(hub)
    cursor, seen = await b.read_assignments("", block_s=0)
    assert seen == []
    waiting = asyncio.create_task(b.read_assignments(cursor, block_s=5))
    await asyncio.sleep(0.05)
    await a.publish_assignments([Assignment("p1", "w1", (1, 2, 3))])
    cursor, seen = await waiting
    assert seen == [Assignment("p1", "w1", (1, 2, 3))]
    cursor, seen = await b.read_assignments(cursor, block_s=0.01)
    assert seen == []
    await a.close()
    await b.close()


async def test_load_lease_registry_and_telemetry_are_shared(hub: HubServer) -> None:
    a, b = await _client(hub), await _client(hub)
    await a.publish_load("p1", {"w1": 100}, ttl_s=5)
    await b.publish_load("p2", {"w1": 5, "w2": 7}, ttl_s=5)
    assert await a.read_load(exclude_origin="p1") == {"w1": 5, "w2": 7}
    assert await b.read_load(exclude_origin="p2") == {"w1": 100}
    assert await a.try_lead("p1", ttl_s=5)
    assert not await b.try_lead("p2", ttl_s=5)
    assert await a.try_lead("p1", ttl_s=5)
    await a.register_worker(WorkerRecord("w1", "http://127.0.0.1:1", ("m",)), ttl_s=5)
    assert [r.id for r in await b.list_workers()] == ["w1"]
    await a.add_telemetry([CacheReport("w1", "t", 100, 60, 80)])
    assert (await b.read_telemetry()).workers["w1"].matched_tokens == 60
    await a.log_action({"kind": "spread"}, keep=10)
    assert await b.recent_actions(5) == [{"kind": "spread"}]
    await a.close()
    await b.close()


async def test_unreachable_hub_is_store_unavailable(tmp_path: Path) -> None:
    store = HubStore("hub://" + str(tmp_path / "missing.sock"))
    await store.start()  # tolerated: sync retries
    with pytest.raises(StoreUnavailable):
        await store.list_workers()


async def test_hub_gone_mid_call_fails_the_call(hub: HubServer) -> None:
    store = await _client(hub)
    cursor, _ = await store.read_assignments("", block_s=0)
    waiting = asyncio.create_task(store.read_assignments(cursor, block_s=10))
    await asyncio.sleep(0.05)
    await hub.close()
    with pytest.raises(StoreUnavailable):
        await waiting
    await store.close()


def test_only_hub_urls() -> None:
    with pytest.raises(ValueError, match="hub://"):
        HubStore("redis://localhost")


async def test_named_leases_are_first_come_and_replaceable(hub: HubServer) -> None:
    a, b = await _client(hub), await _client(hub)
    assert await a.lease("warmup:w1", "warming:p1", 5.0) == "warming:p1"
    assert await b.lease("warmup:w1", "warming:p2", 5.0) == "warming:p1"  # taken
    assert await b.lease("warmup:w2", "warming:p2", 5.0) == "warming:p2"  # another name
    assert await a.lease("warmup:w1", "done:p1", 5.0, True) == "done:p1"
    assert await b.lease("warmup:w1", "warming:p2", 5.0) == "done:p1"
    assert await a.lease("short", "x", 0.01) == "x"
    await asyncio.sleep(0.05)
    assert await b.lease("short", "y", 5.0) == "y"  # the first one lapsed
    await a.close()
    await b.close()


async def test_a_pin_one_process_sets_is_read_by_another(hub: HubServer) -> None:
    a, b = await _client(hub), await _client(hub)
    await a.pin("resp:1", "w1", 5.0)
    assert await b.pinned("resp:1") == "w1"
    assert await b.pinned("resp:2") is None
    await b.unpin("resp:1")
    assert await a.pinned("resp:1") is None
    await a.close()
    await b.close()
