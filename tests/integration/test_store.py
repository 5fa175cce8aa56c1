"""The metadata store contract, on the embedded store and on a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis_asyncio

from gateway.store.base import (
    Assignment,
    CacheReport,
    MetadataStore,
    StoreUnavailable,
    WorkerRecord,
)
from gateway.store.memory import MemoryStore
from gateway.store.redis import RedisStore
from tests.conftest import RedisServer, free_port

RECORD = WorkerRecord("w1", "http://127.0.0.1:9001", ("m",), 2048, 16)


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[MetadataStore]:
    s: MetadataStore = MemoryStore() if request.param == "memory" else RedisStore(
        redis_server.url, prefix="t")
    await s.start()
    yield s
    await s.close()


async def test_registry_round_trip_and_expiry(store: MetadataStore) -> None:
    await store.register_worker(RECORD, ttl_s=0.3)
    assert await store.list_workers() == [RECORD]
    await asyncio.sleep(0.5)
    assert await store.list_workers() == []
    await store.register_worker(RECORD, ttl_s=10)
    await store.deregister_worker("w1")
    assert await store.list_workers() == []


async def test_telemetry_counts_per_worker_and_tenant(store: MetadataStore) -> None:
    await store.add_telemetry([
        CacheReport("w1", "tA", 100, 50, 60),
        CacheReport("w1", "tB", 100, 0, 80),
        CacheReport("w2", "tA", 10, 10, 0),
    ])
    telemetry = await store.read_telemetry()
    assert telemetry.workers["w1"].as_dict() == {
        "requests": 2, "input_tokens": 200, "matched_tokens": 50, "predicted_tokens": 140,
        "mispredicted": 1,
    }
    assert telemetry.tenants["tA"].requests == 2


async def test_leader_lease_and_action_log(store: MetadataStore) -> None:
    assert await store.try_lead("g1", ttl_s=5)
    assert await store.try_lead("g1", ttl_s=5)
    for i in range(5):
        await store.log_action({"id": str(i)}, keep=3)
    assert [a["id"] for a in await store.recent_actions(10)] == ["4", "3", "2"]


async def test_redis_lease_is_exclusive(redis_server: RedisServer) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    await a.start()
    await b.start()
    assert await a.try_lead("g1", ttl_s=0.3)
    assert not await b.try_lead("g2", ttl_s=0.3)
    await asyncio.sleep(0.5)
    assert await b.try_lead("g2", ttl_s=0.3)
    await a.close()
    await b.close()


async def test_redis_named_lease_first_come_replaceable_and_lapsing(
    redis_server: RedisServer,
) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    await a.start()
    await b.start()
    assert await a.lease("warmup:w1", "warming:g1", 0.3) == "warming:g1"
    assert await b.lease("warmup:w1", "warming:g2", 0.3) == "warming:g1"
    assert await a.lease("warmup:w1", "done:g1", 5.0, True) == "done:g1"
    assert await b.lease("warmup:w1", "warming:g2", 5.0) == "done:g1"
    assert await b.lease("other", "x", 0.2) == "x"
    await asyncio.sleep(0.4)
    assert await a.lease("other", "y", 5.0) == "y"
    await a.close()
    await b.close()


async def test_redis_shares_assignments_and_load_between_replicas(
    redis_server: RedisServer,
) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    await a.start()
    await b.start()
    cursor, seen = await b.read_assignments("", block_s=0.05)
    assert seen == []
    await a.publish_assignments([Assignment("ga", "w1", (1, 2, 2**64 - 1))])
    cursor, seen = await b.read_assignments(cursor, block_s=1.0)
    assert seen == [Assignment("ga", "w1", (1, 2, 2**64 - 1))]
    await a.publish_load("ga", {"w1": 100, "w2": 5}, ttl_s=5)
    await b.publish_load("gb", {"w1": 7}, ttl_s=5)
    assert await b.read_load(exclude_origin="gb") == {"w1": 100, "w2": 5}
    assert await a.read_load(exclude_origin="ga") == {"w1": 7}
    await a.close()
    await b.close()


async def test_assignment_entries_another_writer_laid_out_are_skipped(
    redis_server: RedisServer,
) -> None:
    """An entry this version cannot read (another version's fields, a hand-made XADD, a
    packed list cut short) is passed over and counted: the reader's cursor moves past it, so
    one such entry cannot stop every gateway's stream, nor make it read the entry forever."""
    a, b = RedisStore(redis_server.url, prefix="u"), RedisStore(redis_server.url, prefix="u")
    await a.start()
    await b.start()
    cursor, _ = await b.read_assignments("", block_s=0.05)
    await a.publish_assignments([Assignment("ga", "w1", (1, 2))])
    raw = redis_asyncio.from_url(redis_server.url)
    await raw.xadd("u:assignments", {"origin": "gx", "worker": "w9"})  # other field names
    await raw.xadd("u:assignments", {"o": "gx", "w": "w9", "b": b"\x01" * 12})  # cut short
    await raw.xadd("u:assignments", {"o": b"\xff", "w": "w9", "b": b"\x01" * 8})  # not UTF-8
    await a.publish_assignments([Assignment("ga", "w2", (3, 4), (64, 96))])  # with depths
    cursor, seen = await b.read_assignments(cursor, block_s=1.0)
    assert seen == [Assignment("ga", "w1", (1, 2)), Assignment("ga", "w2", (3, 4), (64, 96))]
    assert b.unreadable == 3
    assert (await b.read_assignments(cursor, block_s=0.05))[1] == []  # past them for good
    _, recent = await b.recent_assignments(max_age_s=60, limit=100)
    assert recent == seen  # the depths too, as an index rebuilt at start records them
    await raw.aclose()
    await a.close()
    await b.close()


async def test_unreachable_redis_raises_store_unavailable() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    await store.start()
    with pytest.raises(StoreUnavailable):
        await store.list_workers()
    await store.close()


async def test_pins_bind_a_name_to_a_worker_until_they_lapse_or_are_dropped(
    store: MetadataStore,
) -> None:
    await store.pin("resp:a", "w1", ttl_s=5)
    await store.pin("resp:b", "w2", ttl_s=0.2)
    assert await store.pinned("resp:a") == "w1"
    assert await store.pinned("resp:b") == "w2"
    assert await store.pinned("resp:c") is None
    await store.unpin("resp:a")
    assert await store.pinned("resp:a") is None
    await asyncio.sleep(0.4)
    assert await store.pinned("resp:b") is None  # lapsed


async def test_the_embedded_store_keeps_the_newest_pins_past_its_cap() -> None:
    store = MemoryStore()
    store.max_pins = 3
    for i in range(5):
        await store.pin(f"p{i}", f"w{i}", ttl_s=60)
    assert [await store.pinned(f"p{i}") for i in range(5)] == [None, None, "w2", "w3", "w4"]
