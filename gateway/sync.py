"""Keeps the gateway's local routing state and the shared metadata store in step.

Background loops, one per concern, each tolerant of the store going away:

* membership: registered workers join the pool; one whose entry is gone leaves it only once
  the health probes also find it down (a Redis restart, flush or freeze removes entries, not
  workers, and must not empty the pool or wipe the index); ring weights and the index's
  capacity model follow each worker's registered cache size;
* assignments: prefixes this replica routed are published in batches; those other replicas
  routed are read and recorded in the local index. A starting replica first replays the
  stream's recent history, so a restart does not begin with an empty index. The processes of
  one gateway (``--procs N``) also send each other every decision as it is made
  (:mod:`gateway.store.peers`) and take in the others' right before each decision
  (:meth:`StoreSync.catch_up`). From the stream a process then takes only the decisions of
  gateways it does not hear that way (other hosts' replicas sharing Redis); with the hub,
  which only the processes share, it serves a restarting process's history alone;
* load: this replica's in-flight tokens per worker are published; the other replicas' shares
  are read and added to the snapshot;
* telemetry: cache reports from responses are added to the shared counters.

When the store is unreachable, routing goes on with the local index and the last known
membership; one warning is logged per outage and one line when the store is back. Buffers are
bounded, so an outage cannot grow memory without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from gateway.backends.base import CACHE_CAPACITY_TOKENS
from gateway.contracts.registry_signing import verified
from gateway.contracts.tasks import stop_if_cancelled
from gateway.fingerprint import PrefixKey
from gateway.kvevents.endpoints import EventEndpoints
from gateway.pool import WorkerPool
from gateway.registry_trust import trusted_capacities
from gateway.routing.prefix_index import PrefixIndex
from gateway.store.base import (
    Assignment,
    CacheReport,
    MetadataStore,
    StoreUnavailable,
    WorkerRecord,
)
from gateway.store.peers import PeerLink

log = logging.getLogger(__name__)

_BUFFER_LIMIT = 10_000
_PEER_RETRY_S = 0.002  # decisions a full peer queue held back are sent again this soon


class StoreHealth:
    """Logs once per outage, not once per failed call."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.available = True
        self.outages = 0

    def failed(self, exc: Exception) -> None:
        if self.available:
            self.available = False
            self.outages += 1
            log.warning("metadata store %s unavailable (%s); routing on local state", self._url,
                        exc)

    def ok(self) -> None:
        if not self.available:
            self.available = True
            log.info("metadata store %s reachable again; sharing state", self._url)


class StoreSync:
    def __init__(
        self,
        store: MetadataStore,
        pool: WorkerPool,
        index: PrefixIndex,
        *,
        origin: str,
        tokens_per_block: float,
        membership_interval_s: float = 1.0,
        load_interval_s: float = 0.1,
        flush_interval_s: float = 0.02,
        telemetry_interval_s: float = 1.0,
        shares_state: bool = True,
        history_s: float = 600.0,
        history_entries: int = 5000,
        max_weight: float = 4.0,
        registry_secret: bytes = b"",
        peer_dir: str = "",
        peers_only: bool = True,
    ) -> None:
        self._max_weight = max_weight
        self._registry_secret = registry_secret
        self._rejected: set[str] = set()  # ids of ignored entries, each logged once
        self.store = store
        self.pool = pool
        self.index = index
        self.origin = origin
        self.health = StoreHealth(store.url)
        self._tokens_per_block = tokens_per_block
        self._intervals = (membership_interval_s, load_interval_s, flush_interval_s,
                           telemetry_interval_s)
        self._shares_state = shares_state
        self._history = (history_s, history_entries)
        self._assignments: deque[Assignment] = deque(maxlen=_BUFFER_LIMIT)
        self._reports: deque[CacheReport] = deque(maxlen=_BUFFER_LIMIT)
        self._tasks: list[asyncio.Task[None]] = []
        self._cursor = ""
        # With the other processes of one gateway: decisions sent as they are made. With
        # ``peers_only`` nobody else shares the store, so its stream is left unread then.
        self._peer_dir = peer_dir if shares_state else ""
        self._peers_only = peers_only
        self.peers: PeerLink | None = None
        self._peer_retry: asyncio.TimerHandle | None = None
        self._linked: set[str] = set()  # origins heard through the sockets
        # Called with a registry worker's id when its entry is gone but it is still healthy:
        # the health checker probes it soon (gateway.health), rather than at its turn.
        self.gone: Callable[[str], None] | None = None

    @property
    def shares_state(self) -> bool:
        """Other gateways (replicas, or the processes of ``--procs N``) share the store."""
        return self._shares_state

    # -- called on the request path (no I/O) --------------------------------------------------
    def assigned(self, key: PrefixKey, worker_id: str) -> None:
        if self._shares_state and key.blocks:
            self._assignments.append(Assignment(self.origin, worker_id, key.blocks, key.depths))
            if self.peers is not None:
                self.peers.publish(worker_id, key.blocks, key.depths)
                if self.peers.pending and self._peer_retry is None:
                    self._peer_retry = asyncio.get_running_loop().call_later(
                        _PEER_RETRY_S, self._retry_peers)

    def catch_up(self, now: float) -> None:
        """Record what the other processes of this gateway decided since the last call (a
        non-blocking read; before each decision, so that it sees theirs up to this instant)."""
        if self.peers is None:
            return
        pool, index, linked = self.pool, self.index, self._linked
        for origin, worker_id, blocks, depths in self.peers.receive():
            if origin not in linked and len(linked) < _BUFFER_LIMIT:
                linked.add(origin)  # its decisions on the store's stream are known already
            # Depths, when given, name one checkpoint each (PrefixKey); anything else is not
            # a decision of ours and must not reach the index (or fail a request).
            if worker_id in pool and (not depths or len(depths) == len(blocks)):
                index.record(blocks, worker_id, now, depths)

    def _peers_sent(self) -> None:
        self.catch_up(time.monotonic())

    def _retry_peers(self) -> None:
        self._peer_retry = None
        if self.peers is None:
            return
        self.peers.flush()
        if self.peers.pending:
            self._peer_retry = asyncio.get_running_loop().call_later(
                _PEER_RETRY_S, self._retry_peers)

    def reported(self, report: CacheReport) -> None:
        self._reports.append(report)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self._guard(self.sync_membership)
        if self._shares_state:
            with contextlib.suppress(StoreUnavailable):
                await self._guard(self.replay_history)
        membership, load, flush, telemetry = self._intervals
        loops: list[tuple[str, Callable[[], Awaitable[None]], float]] = [
            ("membership", self.sync_membership, membership),
            ("telemetry", self._flush_telemetry, telemetry),
        ]
        if self._shares_state:
            loops += [
                ("load", self._sync_load, load),
                ("publish", self._flush_assignments, flush),
            ]
            if self._peer_dir:
                try:
                    self.peers = PeerLink(self._peer_dir, self.origin)
                except OSError as exc:  # e.g. a socket path over the system's length limit
                    log.warning("decisions go to the other processes through the hub's "
                                "stream only (no socket in %s: %s)", self._peer_dir, exc)
            if self.peers is not None:
                # Between decisions too: what arrives while this process routes nothing.
                asyncio.get_running_loop().add_reader(self.peers.fileno(), self._peers_sent)
            if self.peers is None or not self._peers_only:
                loops.append(("subscribe", self._read_assignments, 0.0))
        for name, fn, every in loops:
            self._tasks.append(asyncio.create_task(self._loop(fn, every), name=f"sync-{name}"))

    async def stop(self) -> None:
        if self.peers is not None:
            asyncio.get_running_loop().remove_reader(self.peers.fileno())
            if self._peer_retry is not None:
                self._peer_retry.cancel()
                self._peer_retry = None
            self.peers.close()
            self.peers = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        with contextlib.suppress(StoreUnavailable):
            await self._flush_telemetry()

    async def _guard(self, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await fn()
        except StoreUnavailable as exc:
            self.health.failed(exc)
            raise
        self.health.ok()

    async def _loop(self, fn: Callable[[], Awaitable[None]], every_s: float) -> None:
        while True:
            pause = every_s
            try:
                await self._guard(fn)
            except StoreUnavailable:
                pause = max(every_s, 0.5)
            except Exception:
                log.exception("store sync step %s failed", getattr(fn, "__name__", fn))
                # A step that fails the same way each time must not spin (the stream reader's
                # interval is 0) nor flood the log.
                pause = max(every_s, 1.0)
            stop_if_cancelled()
            await asyncio.sleep(pause)

    # -- the loops ----------------------------------------------------------------------------
    async def sync_membership(self) -> None:
        records = self._trusted(await self.store.list_workers())
        registered = {r.id for r in records}
        for record in records:
            events = EventEndpoints(record.kv_events, record.kv_replay) if record.kv_events \
                else None
            known = record.id in self.pool
            if not known:
                self.pool.add(record.url, wid=record.id, source="registry", kind=record.kind,
                              events=events, dp_size=record.dp_size)
            if events is not None:
                self.pool.set_events(record.id, events)
            if known:
                continue  # its health is the probes' business from now on
            if record.models:
                self.pool.mark_up(record.id, frozenset(record.models))
        for state in self.pool.states():
            if state.source != "registry" or state.worker.endpoint_id in registered:
                continue
            if not state.healthy:
                self.pool.remove(state.worker.id)
            elif self.gone is not None:
                self.gone(state.worker.id)
        self._apply_capacities(records)

    def _trusted(self, records: Sequence[WorkerRecord]) -> list[WorkerRecord]:
        """The records signed with the registration secret (all of them without one); each
        ignored worker id is logged once."""
        kept = []
        for record in records:
            if verified(record, self._registry_secret):
                kept.append(record)
                self._rejected.discard(record.id)
            elif record.id not in self._rejected and len(self._rejected) < _BUFFER_LIMIT:
                self._rejected.add(record.id)
                log.warning("registry entry %s ignored: %s signature", record.id,
                            "bad" if record.signature else "no")
        return kept

    def _apply_capacities(self, records: Sequence[WorkerRecord]) -> None:
        """Ring weights follow cache capacity as far as probes confirm it (see
        :mod:`gateway.registry_trust`); the index models each worker's believed size."""
        probed = {
            r.id: self.pool.get(r.id).engine_metrics.get(CACHE_CAPACITY_TOKENS, 0.0)
            for r in records if r.id in self.pool
        }
        trusted = trusted_capacities(records, probed, self._max_weight)
        self.pool.set_weights(trusted.weights)
        for wid, tokens in trusted.capacity_tokens.items():
            self.pool.set_capacity(wid, max(1, int(tokens / self._tokens_per_block)))

    async def _sync_load(self) -> None:
        ttl = max(2.0, 20 * self._intervals[1])
        await self.store.publish_load(self.origin, self.pool.local_load(), ttl)
        self.pool.set_remote_load(await self.store.read_load(exclude_origin=self.origin))

    async def _flush_assignments(self) -> None:
        if not self._assignments:
            return
        batch = list(self._assignments)
        self._assignments.clear()
        try:
            await self.store.publish_assignments(batch)
        except StoreUnavailable:
            # Only the newest survive an outage: old decisions are stale by the time it ends.
            self._assignments.extendleft(reversed(batch[-1000:]))
            raise

    async def replay_history(self) -> None:
        """Record the stream's recent assignments (every replica's, this one's before a
        restart too) and read on from its newest entry."""
        max_age_s, limit = self._history
        cursor, batch = await self.store.recent_assignments(max_age_s, limit)
        now = time.monotonic()
        replayed = 0
        for a in batch:
            if a.worker_id in self.pool:
                self.index.record(a.blocks, a.worker_id, now, a.depths)
                replayed += 1
        self._cursor = cursor
        if replayed:
            log.info("prefix index rebuilt from %d recent assignments", replayed)

    async def _read_assignments(self) -> None:
        self._cursor, batch = await self.store.read_assignments(self._cursor, block_s=1.0)
        now = time.monotonic()
        linked = self._linked
        for a in batch:
            if a.origin != self.origin and a.origin not in linked and a.worker_id in self.pool:
                self.index.record(a.blocks, a.worker_id, now, a.depths)

    async def _flush_telemetry(self) -> None:
        if not self._reports:
            return
        batch = list(self._reports)
        self._reports.clear()
        await self.store.add_telemetry(batch)
