"""Redis as the shared metadata store of many gateway replicas and self-registering workers.

Key schema (``{p}`` is the configurable prefix, ``affinity`` by default). Every key is bounded by
a TTL or a length cap; values are ids, hashes and counters, never prompt text.

======================================  ======  =============================================
key                                     type    content, bound
======================================  ======  =============================================
``{p}:workers``, ``{p}:worker:<id>``   zset,   the worker registry, defined in
                                        hash    :mod:`gateway.contracts.registry`
``{p}:assignments``                     stream  origin, worker, packed 64-bit block hashes;
                                                approximate MAXLEN
``{p}:gateways``                        zset    replica id -> expiry (ms) of its load share
``{p}:load:<replica>``                  hash    worker id -> in-flight tokens; TTL a few s
``{p}:telemetry:worker:<id>``           hash    requests, input/matched/predicted tokens,
                                                mispredicted; TTL 1 day, refreshed
``{p}:telemetry:tenant:<hash>``         hash    the same per tenant (keyed hash of the tenant)
``{p}:leader``                          string  replica id holding the rebalancer lease; PX TTL
``{p}:rebalance``                       list    JSON of recent rebalancer actions; capped
======================================  ======  =============================================
"""

from __future__ import annotations

import json
import struct
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis

from gateway.contracts import registry
from gateway.contracts.redact import redact_url
from gateway.store.base import (
    Assignment,
    CacheReport,
    HitCounters,
    StoreUnavailable,
    Telemetry,
    WorkerRecord,
    is_misprediction,
)

T = TypeVar("T")

TELEMETRY_TTL_S = 86_400
_LEAD_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_LEASE_SCRIPT = """
if ARGV[3] ~= '1' then
  local held = redis.call('GET', KEYS[1])
  if held then return held end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""
_COUNTER_FIELDS = ("requests", "input_tokens", "matched_tokens", "predicted_tokens",
                   "mispredicted")


def _pack(blocks: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(blocks)}Q", *blocks)


def _unpack(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


# What an assignment entry that another writer (another version, a hand-made XADD) laid out
# otherwise raises as it is read.
_UNREADABLE = (KeyError, TypeError, ValueError, struct.error)


def _assignment(fields: Mapping[Any, Any]) -> Assignment | None:
    """An assignment from a stream entry's fields (None: not one this version can read)."""
    try:
        f = {_s(k): v for k, v in fields.items()}
        depths = _unpack(f["d"]) if "d" in f else ()
        return Assignment(_s(f["o"]), _s(f["w"]), _unpack(f["b"]), depths)
    except _UNREADABLE:  # UnicodeDecodeError is a ValueError
        return None


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "affinity",
        timeout_s: float = 0.5,
        stream_maxlen: int = 20_000,
    ) -> None:
        self._url = url
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._stream_maxlen = stream_maxlen
        self._client: aioredis.Redis | None = None
        self._reader: aioredis.Redis | None = None  # blocking stream reads get their own
        self.unreadable = 0  # see MetadataStore.unreadable

    @property
    def url(self) -> str:
        """The store's URL for display and logs: any password is replaced by ``***``."""
        return redact_url(self._url)

    def key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def start(self) -> None:
        common: dict[str, Any] = {"socket_connect_timeout": self._timeout_s, "retry": None}
        self._client = aioredis.Redis.from_url(
            self._url, socket_timeout=self._timeout_s, **common
        )
        self._reader = aioredis.Redis.from_url(self._url, socket_timeout=5.0, **common)

    async def close(self) -> None:
        for client in (self._client, self._reader):
            if client is not None:
                await client.aclose()
        self._client = self._reader = None

    @property
    def _r(self) -> aioredis.Redis:
        if self._client is None:
            raise StoreUnavailable("store not started")
        return self._client

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        return await registry.unavailable_as_store_error(self._url, op)

    # -- worker registry (schema: gateway.contracts.registry) ------------------------------
    async def register_worker(self, record: WorkerRecord, ttl_s: float) -> None:
        await self._call(lambda: registry.register(self._r, self._prefix, record, ttl_s))

    async def deregister_worker(self, worker_id: str) -> None:
        await self._call(lambda: registry.deregister(self._r, self._prefix, worker_id))

    async def list_workers(self) -> list[WorkerRecord]:
        return await self._call(lambda: registry.list_records(self._r, self._prefix))

    # -- prefix assignments -------------------------------------------------------------------
    async def publish_assignments(self, batch: Sequence[Assignment]) -> None:
        if not batch:
            return

        async def op() -> None:
            async with self._r.pipeline(transaction=False) as pipe:
                for a in batch:
                    fields = {"o": a.origin, "w": a.worker_id, "b": _pack(a.blocks)}
                    if a.depths:
                        fields["d"] = _pack(a.depths)
                    pipe.xadd(
                        self.key("assignments"),
                        fields,  # type: ignore[arg-type]
                        maxlen=self._stream_maxlen,
                        approximate=True,
                    )
                await pipe.execute()

        await self._call(op)

    async def read_assignments(self, cursor: str, block_s: float) -> tuple[str, list[Assignment]]:
        reader = self._reader
        if reader is None:
            raise StoreUnavailable("store not started")

        async def op() -> tuple[str, list[Assignment]]:
            key = self.key("assignments")
            # First read: start from the newest entry now (not "$", which would lose what
            # arrives between this read and the next).
            last = cursor or await self._last_entry_id(key)
            reply: Any = await reader.xread({key: last}, count=1000, block=int(block_s * 1000))
            out: list[Assignment] = []
            for _stream, entries in reply or []:  # [(stream, [(id, fields), ...])]
                for entry_id, fields in entries:
                    last = _s(entry_id)  # past an entry that does not read, too
                    assignment = _assignment(fields)
                    if assignment is None:
                        self.unreadable += 1
                    else:
                        out.append(assignment)
            return last, out

        return await self._call(op)

    async def recent_assignments(
        self, max_age_s: float, limit: int
    ) -> tuple[str, list[Assignment]]:
        async def op() -> tuple[str, list[Assignment]]:
            key = self.key("assignments")
            cursor = await self._last_entry_id(key)
            oldest = f"{max(0, int((time.time() - max_age_s) * 1000))}-0"
            # Stream ids start with their time in ms: the newest ``limit`` since ``oldest``.
            rows: Any = await self._r.xrevrange(key, max=cursor, min=oldest, count=limit)
            out = []
            for _id, fields in reversed(rows):
                assignment = _assignment(fields)
                if assignment is None:
                    self.unreadable += 1
                else:
                    out.append(assignment)
            return cursor, out

        return await self._call(op)

    async def _last_entry_id(self, key: str) -> str:
        if not await self._r.exists(key):
            return "0-0"
        info: Any = await self._r.xinfo_stream(key)
        return _s(info["last-generated-id"])

    # -- load ---------------------------------------------------------------------------------
    async def publish_load(self, origin: str, load: Mapping[str, int], ttl_s: float) -> None:
        ttl_ms = int(ttl_s * 1000)

        async def op() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                key = self.key("load", origin)
                pipe.delete(key)
                if load:
                    pipe.hset(key, mapping=cast(Any, {w: str(t) for w, t in load.items()}))
                    pipe.pexpire(key, ttl_ms)
                pipe.zadd(self.key("gateways"), {origin: time.time() * 1000 + ttl_ms})
                await pipe.execute()

        await self._call(op)

    async def read_load(self, exclude_origin: str) -> dict[str, int]:
        async def op() -> dict[str, int]:
            now_ms = time.time() * 1000
            await self._r.zremrangebyscore(self.key("gateways"), "-inf", now_ms)
            origins = [
                _s(o) for o in cast(list[bytes], await self._r.zrange(self.key("gateways"), 0, -1))
            ]
            others = [o for o in origins if o != exclude_origin]
            async with self._r.pipeline(transaction=False) as pipe:
                for origin in others:
                    pipe.hgetall(self.key("load", origin))
                rows = await pipe.execute()
            total: dict[str, int] = defaultdict(int)
            for row in rows:
                for w, t in row.items():
                    total[_s(w)] += int(t)
            return dict(total)

        return await self._call(op)

    # -- hit telemetry ------------------------------------------------------------------------
    async def add_telemetry(self, reports: Sequence[CacheReport]) -> None:
        if not reports:
            return
        per_worker: dict[str, HitCounters] = defaultdict(HitCounters)
        per_tenant: dict[str, HitCounters] = defaultdict(HitCounters)
        for report in reports:
            per_worker[report.worker_id].add(report)
            per_tenant[report.tenant or "-"].add(report)

        async def op() -> None:
            async with self._r.pipeline(transaction=False) as pipe:
                for kind, groups in (("worker", per_worker), ("tenant", per_tenant)):
                    for name, counters in groups.items():
                        key = self.key("telemetry", kind, name)
                        for field_name, value in counters.as_dict().items():
                            if value:
                                pipe.hincrby(key, field_name, value)
                        pipe.expire(key, TELEMETRY_TTL_S)
                await pipe.execute()

        await self._call(op)

    async def read_telemetry(self) -> Telemetry:
        async def op() -> Telemetry:
            groups: dict[str, dict[str, HitCounters]] = {"worker": {}, "tenant": {}}
            for kind, out in groups.items():
                keys = [_s(k) async for k in self._r.scan_iter(
                    match=self.key("telemetry", kind, "*"), count=500)]
                async with self._r.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.hgetall(key)
                    rows = await pipe.execute()
                for key, row in zip(keys, rows, strict=True):
                    f = {_s(k): int(v) for k, v in row.items()}
                    name = key.rsplit(":", 1)[1]
                    out[name] = HitCounters(**{k: f.get(k, 0) for k in _COUNTER_FIELDS})
            return Telemetry(workers=groups["worker"], tenants=groups["tenant"])

        return await self._call(op)

    # -- coordination -------------------------------------------------------------------------
    async def try_lead(self, origin: str, ttl_s: float) -> bool:
        async def op() -> bool:
            result = self._r.eval(_LEAD_SCRIPT, 1, self.key("leader"), origin,
                                  str(int(ttl_s * 1000)))
            return bool(await cast(Awaitable[int], result))

        return await self._call(op)

    async def lease(self, name: str, value: str, ttl_s: float, replace: bool = False) -> str:
        async def op() -> str:
            result = self._r.eval(_LEASE_SCRIPT, 1, self.key("lease", name), value,
                                  str(max(1, int(ttl_s * 1000))), "1" if replace else "0")
            held = await cast(Awaitable[bytes | str], result)
            return held.decode() if isinstance(held, bytes) else str(held)

        return await self._call(op)

    async def pin(self, name: str, worker_id: str, ttl_s: float) -> None:
        async def op() -> None:
            await self._r.set(self.key("pin", name), worker_id, px=max(1, int(ttl_s * 1000)))

        await self._call(op)

    async def pinned(self, name: str) -> str | None:
        async def op() -> str | None:
            held = await cast(Awaitable[bytes | None], self._r.get(self.key("pin", name)))
            return held.decode() if held is not None else None

        return await self._call(op)

    async def unpin(self, name: str) -> None:
        async def op() -> None:
            await self._r.delete(self.key("pin", name))

        await self._call(op)

    async def log_action(self, action: Mapping[str, object], keep: int) -> None:
        async def op() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.lpush(self.key("rebalance"), json.dumps(action))
                pipe.ltrim(self.key("rebalance"), 0, keep - 1)
                await pipe.execute()

        await self._call(op)

    async def recent_actions(self, limit: int) -> list[dict[str, object]]:
        async def op() -> list[dict[str, object]]:
            raw = await cast(Awaitable[list[bytes]],
                             self._r.lrange(self.key("rebalance"), 0, limit - 1))
            return [json.loads(r) for r in raw]

        return await self._call(op)


def is_redis_url(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


__all__ = ["RedisStore", "is_misprediction", "is_redis_url"]
