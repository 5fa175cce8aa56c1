"""The worker registry in Redis: its key schema and the client a worker registers itself with.

Two keys per prefix ``{p}`` (``affinity`` by default) hold the registry:

* ``{p}:workers``: a sorted set, worker id -> expiry in ms (stale members are pruned on read);
* ``{p}:worker:<id>``: a hash of the record (url, models, capacity_blocks, block_size, kind,
  kv_events, kv_replay, dp_size, sig), expiring with the heartbeat TTL.

The gateway's store (:class:`gateway.store.redis.RedisStore`) and the worker
(:class:`RegistryClient`) write and read these keys through the functions here, so the schema
has one definition. Every failure to reach Redis is raised as :class:`StoreUnavailable`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.contracts.redact import redact_url
from gateway.contracts.worker_record import WorkerRecord

T = TypeVar("T")


class StoreUnavailable(Exception):
    """The store could not be reached or answered with an error."""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def workers_key(prefix: str) -> str:
    return f"{prefix}:workers"


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:worker:{worker_id}"


def record_fields(record: WorkerRecord) -> dict[str, str]:
    """The hash fields ``record`` is stored as (its id is the key's last part)."""
    return {
        "url": record.url,
        "models": ",".join(record.models),
        "capacity_blocks": str(record.capacity_blocks),
        "block_size": str(record.block_size),
        "kind": record.kind,
        "kv_events": record.kv_events,
        "kv_replay": record.kv_replay,
        "dp_size": str(record.dp_size),
        "sig": record.signature,
    }


def record_from_fields(worker_id: str, row: Mapping[bytes | str, bytes | str]) -> WorkerRecord:
    """The record stored as the hash ``row`` (missing fields take their defaults)."""
    f = {_s(k): _s(v) for k, v in row.items()}
    return WorkerRecord(
        id=worker_id,
        url=f.get("url", ""),
        models=tuple(m for m in f.get("models", "").split(",") if m),
        capacity_blocks=int(f.get("capacity_blocks", "0") or 0),
        block_size=int(f.get("block_size", "16") or 16),
        kind=f.get("kind", "openai"),
        kv_events=f.get("kv_events", ""),
        kv_replay=f.get("kv_replay", ""),
        dp_size=int(f.get("dp_size", "1") or 1),
        signature=f.get("sig", ""),
    )


async def register(client: aioredis.Redis, prefix: str, record: WorkerRecord,
                   ttl_s: float) -> None:
    """Add or refresh ``record``; it disappears ``ttl_s`` after its last refresh."""
    ttl_ms = int(ttl_s * 1000)
    key = worker_key(prefix, record.id)
    async with client.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping=cast(Any, record_fields(record)))
        pipe.pexpire(key, ttl_ms)
        pipe.zadd(workers_key(prefix), {record.id: time.time() * 1000 + ttl_ms})
        await pipe.execute()


async def deregister(client: aioredis.Redis, prefix: str, worker_id: str) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(worker_key(prefix, worker_id))
        pipe.zrem(workers_key(prefix), worker_id)
        await pipe.execute()


async def list_records(client: aioredis.Redis, prefix: str) -> list[WorkerRecord]:
    """Every live record (members whose heartbeat expired are pruned first)."""
    await client.zremrangebyscore(workers_key(prefix), "-inf", time.time() * 1000)
    ids = [_s(i) for i in cast(list[bytes], await client.zrange(workers_key(prefix), 0, -1))]
    async with client.pipeline(transaction=False) as pipe:
        for wid in ids:
            pipe.hgetall(worker_key(prefix, wid))
        rows = await pipe.execute()
    # A record whose hash expired between the two reads is skipped.
    return [record_from_fields(wid, row) for wid, row in zip(ids, rows, strict=True) if row]


async def unavailable_as_store_error(url: str, op: Callable[[], Awaitable[T]]) -> T:
    """``op()``, with any failure to reach Redis at ``url`` raised as :class:`StoreUnavailable`
    (the message shows the URL without its password)."""
    try:
        return await op()
    except (RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(
            f"redis at {redact_url(url)}: {type(exc).__name__}: {exc}") from exc


class RegistryClient:
    """A worker's own connection to the registry: register, refresh, deregister."""

    def __init__(self, url: str, *, prefix: str = "affinity", timeout_s: float = 0.5) -> None:
        self._url = url
        self._prefix = prefix
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=None)

    @property
    def url(self) -> str:
        """The registry's URL for logs: any password is replaced by ``***``."""
        return redact_url(self._url)

    async def register(self, record: WorkerRecord, ttl_s: float) -> None:
        await unavailable_as_store_error(
            self._url, lambda: register(self._client, self._prefix, record, ttl_s))

    async def deregister(self, worker_id: str) -> None:
        await unavailable_as_store_error(
            self._url, lambda: deregister(self._client, self._prefix, worker_id))

    async def close(self) -> None:
        await self._client.aclose()
