"""The embedded metadata store: one gateway process, no Redis, state in this process only."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from gateway.store.base import (
    Assignment,
    CacheReport,
    HitCounters,
    Telemetry,
    WorkerRecord,
)

_MAX_PINS = 200_000  # about 30 MB of names and worker ids


class MemoryStore:
    unreadable = 0  # it holds only what this process wrote

    def __init__(self) -> None:
        self._workers: dict[str, tuple[WorkerRecord, float]] = {}
        self._workers_hits: dict[str, HitCounters] = {}
        self._tenant_hits: dict[str, HitCounters] = {}
        self._actions: deque[dict[str, object]] = deque(maxlen=1000)
        self._leases: dict[str, tuple[str, float]] = {}
        # Pins, oldest first; bounded: past the cap the oldest go, as Redis would evict them.
        self._pins: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.max_pins = _MAX_PINS

    @property
    def url(self) -> str:
        return "memory://"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def register_worker(self, record: WorkerRecord, ttl_s: float) -> None:
        self._workers[record.id] = (record, time.monotonic() + ttl_s)

    async def deregister_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    async def list_workers(self) -> list[WorkerRecord]:
        now = time.monotonic()
        for wid in [w for w, (_, expiry) in self._workers.items() if expiry < now]:
            del self._workers[wid]
        return [record for record, _ in self._workers.values()]

    async def publish_assignments(self, batch: Sequence[Assignment]) -> None:
        return None  # one process: the local index already has them

    async def read_assignments(self, cursor: str, block_s: float) -> tuple[str, list[Assignment]]:
        return cursor, []

    async def recent_assignments(
        self, max_age_s: float, limit: int
    ) -> tuple[str, list[Assignment]]:
        return "", []  # nothing outlives the one process

    async def publish_load(self, origin: str, load: Mapping[str, int], ttl_s: float) -> None:
        return None

    async def read_load(self, exclude_origin: str) -> dict[str, int]:
        return {}

    async def add_telemetry(self, reports: Sequence[CacheReport]) -> None:
        for report in reports:
            self._workers_hits.setdefault(report.worker_id, HitCounters()).add(report)
            self._tenant_hits.setdefault(report.tenant, HitCounters()).add(report)

    async def read_telemetry(self) -> Telemetry:
        return Telemetry(workers=dict(self._workers_hits), tenants=dict(self._tenant_hits))

    async def try_lead(self, origin: str, ttl_s: float) -> bool:
        return True

    async def lease(self, name: str, value: str, ttl_s: float, replace: bool = False) -> str:
        now = time.monotonic()
        held = self._leases.get(name)
        if held is not None and held[1] > now and not replace:
            return held[0]
        if len(self._leases) > 4096:  # bounded: expired leases go first
            self._leases = {k: v for k, v in self._leases.items() if v[1] > now}
        self._leases[name] = (value, now + ttl_s)
        return value

    async def pin(self, name: str, worker_id: str, ttl_s: float) -> None:
        self._pins.pop(name, None)
        self._pins[name] = (worker_id, time.monotonic() + ttl_s)
        while len(self._pins) > self.max_pins:
            self._pins.popitem(last=False)

    async def pinned(self, name: str) -> str | None:
        held = self._pins.get(name)
        if held is None:
            return None
        if held[1] <= time.monotonic():
            del self._pins[name]
            return None
        return held[0]

    async def unpin(self, name: str) -> None:
        self._pins.pop(name, None)

    async def log_action(self, action: Mapping[str, object], keep: int) -> None:
        self._actions.append(dict(action))
        while len(self._actions) > keep:
            self._actions.popleft()

    async def recent_actions(self, limit: int) -> list[dict[str, object]]:
        return list(self._actions)[-limit:][::-1]
