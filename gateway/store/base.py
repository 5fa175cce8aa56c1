"""The metadata store: what gateway replicas and workers share. Routing metadata only.

What lives here is hashes and numbers: worker records (URL, model, capacity), prefix block
hashes with the worker they were sent to, per-replica load, hit counters. Never prompt text,
never KV data. Two implementations: :class:`gateway.store.memory.MemoryStore` (embedded, one
gateway process, the default) and :class:`gateway.store.redis.RedisStore` (many replicas).

Every method may raise :class:`StoreUnavailable`; callers keep routing on local state when it
does (see :mod:`gateway.sync`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# The record workers register and the error every store method may raise are part of this
# interface; their home is the contracts package, which the worker shares.
from gateway.contracts.registry import StoreUnavailable as StoreUnavailable
from gateway.contracts.worker_record import WorkerRecord as WorkerRecord
from gateway.values import value


@value
class Assignment:
    """A prefix (its checkpoint hashes, ``PrefixKey.blocks``) sent to a worker by one gateway
    replica; ``depths`` as in ``PrefixKey`` (empty: every block a checkpoint)."""

    origin: str
    worker_id: str
    blocks: tuple[int, ...]
    depths: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CacheReport:
    """What one response said about the cache, against what the gateway predicted."""

    worker_id: str
    tenant: str
    input_tokens: int
    matched_tokens: int
    predicted_tokens: int


@dataclass(slots=True)
class HitCounters:
    requests: int = 0
    input_tokens: int = 0
    matched_tokens: int = 0
    predicted_tokens: int = 0
    mispredicted: int = 0  # responses that matched far less than predicted

    def add(self, report: CacheReport) -> None:
        self.requests += 1
        self.input_tokens += report.input_tokens
        self.matched_tokens += report.matched_tokens
        self.predicted_tokens += report.predicted_tokens
        if is_misprediction(report):
            self.mispredicted += 1

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "matched_tokens": self.matched_tokens,
            "predicted_tokens": self.predicted_tokens,
            "mispredicted": self.mispredicted,
        }


def is_misprediction(report: CacheReport) -> bool:
    """The gateway predicted a hit and the worker served less than half of it from cache."""
    return report.predicted_tokens > 0 and report.matched_tokens * 2 < report.predicted_tokens


@dataclass(frozen=True, slots=True)
class Telemetry:
    workers: Mapping[str, HitCounters] = field(default_factory=dict)
    tenants: Mapping[str, HitCounters] = field(default_factory=dict)


class MetadataStore(Protocol):
    # Assignment entries this store read and skipped, not laid out as this version writes
    # them (only a store shared with other writers meets any).
    unreadable: int

    @property
    def url(self) -> str: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # -- worker registry ----------------------------------------------------------------------
    async def register_worker(self, record: WorkerRecord, ttl_s: float) -> None:
        """Add or refresh ``record``; it disappears ``ttl_s`` after its last refresh."""
        ...

    async def deregister_worker(self, worker_id: str) -> None: ...

    async def list_workers(self) -> list[WorkerRecord]: ...

    # -- prefix assignments -------------------------------------------------------------------
    async def publish_assignments(self, batch: Sequence[Assignment]) -> None: ...

    async def read_assignments(self, cursor: str, block_s: float) -> tuple[str, list[Assignment]]:
        """Assignments after ``cursor`` ("" = only new ones), waiting up to ``block_s``."""
        ...

    async def recent_assignments(
        self, max_age_s: float, limit: int
    ) -> tuple[str, list[Assignment]]:
        """Up to ``limit`` of the newest assignments at most ``max_age_s`` old, oldest first,
        and the cursor to read on from (what a starting replica rebuilds its index from)."""
        ...

    # -- load ---------------------------------------------------------------------------------
    async def publish_load(self, origin: str, load: Mapping[str, int], ttl_s: float) -> None:
        """This replica's in-flight tokens per worker; gone ``ttl_s`` after the last publish."""
        ...

    async def read_load(self, exclude_origin: str) -> dict[str, int]:
        """In-flight tokens per worker, summed over every live replica but ``exclude_origin``."""
        ...

    # -- hit telemetry ------------------------------------------------------------------------
    async def add_telemetry(self, reports: Sequence[CacheReport]) -> None: ...

    async def read_telemetry(self) -> Telemetry: ...

    # -- coordination -------------------------------------------------------------------------
    async def try_lead(self, origin: str, ttl_s: float) -> bool:
        """Take or keep the rebalancer lease; True while ``origin`` holds it."""
        ...

    async def lease(self, name: str, value: str, ttl_s: float, replace: bool = False) -> str:
        """A named lease shared by every gateway on the store: set ``name`` to ``value`` for
        ``ttl_s`` unless it holds a value already (``replace``: set it regardless); returns
        the value it holds now (``value`` when this call set it)."""
        ...

    # -- pins: a name bound to a worker (where a stored response lives) ------------------------
    async def pin(self, name: str, worker_id: str, ttl_s: float) -> None:
        """Bind ``name`` (a keyed hash, never a client's text) to ``worker_id`` for ``ttl_s``."""
        ...

    async def pinned(self, name: str) -> str | None:
        """The worker ``name`` is bound to, or None (never bound, expired or dropped)."""
        ...

    async def unpin(self, name: str) -> None: ...

    async def log_action(self, action: Mapping[str, object], keep: int) -> None: ...

    async def recent_actions(self, limit: int) -> list[dict[str, object]]: ...
