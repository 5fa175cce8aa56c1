"""The engine-exact index: which token blocks each worker's engine holds, from its events.

One :class:`WorkerBlocks` per worker that publishes KV events: the block keys its engine
reported stored and not yet removed (:mod:`gateway.kvevents.keys`), bounded, plus the blocks
this gateway just sent it (*pending*: the engine will store them as it admits the request, and
its events follow a moment later; they stop counting after ``pending_ttl_s`` unless an event
confirms them). AllBlocksCleared, a restart or a gap in the events that cannot be replayed
empties it, and it rebuilds from the events that follow.

:class:`ExactMatcher` puts the index behind the routing's prefix-match interface: for a worker
with a live event feed the depth comes from here, for every other worker from the modelled
index, so both kinds of worker share one pool and one policy. Pure: no I/O, time passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.kvevents.keys import chain_from, chain_seed, salt_of
from gateway.kvevents.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from gateway.routing.types import PrefixMatcher


@dataclass(slots=True)
class BlockStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0  # stored blocks whose parent was unknown (not keyed)
    dropped: int = 0  # blocks dropped to keep within the bound


class WorkerBlocks:
    """One worker's cached blocks as its engine reported them."""

    def __init__(self, max_blocks: int = 1 << 20, pending_ttl_s: float = 10.0) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self.pending_ttl_s = pending_ttl_s
        self._key_of: dict[BlockHash, int] = {}  # engine hash -> our key
        self._held: dict[int, int] = {}  # our key -> engine blocks holding it (oldest first)
        self._pending: dict[int, float] = {}  # our key -> when this gateway sent it
        self.stats = BlockStats()

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, key: int, now: float) -> bool:
        if key in self._held:
            return True
        sent = self._pending.get(key)
        return sent is not None and now - sent <= self.pending_ttl_s

    def depth(self, keys: Sequence[int], now: float) -> int:
        """Leading keys of ``keys`` this worker holds."""
        held, pending, ttl = self._held, self._pending, self.pending_ttl_s
        n = 0
        for k in keys:
            if k not in held:
                sent = pending.get(k)
                if sent is None or now - sent > ttl:
                    break
            n += 1
        return n

    def confirmed_depth(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._held:
                break
            n += 1
        return n

    # -- events -----------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def _stored(self, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            first = event.extra_keys[0] if event.extra_keys else None
            parent = chain_seed(event.lora_name or "", salt_of(first, event.lora_name))
        else:
            known = self._key_of.get(event.parent_block_hash)
            if known is None:
                self.stats.orphans += len(event.block_hashes)
                return
            parent = known
        keys = chain_from(parent, event.token_ids, event.block_size)
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            old = self._key_of.get(engine_hash)
            if old == key:
                continue
            if old is not None:
                self._release(old)
            self._key_of[engine_hash] = key
            self._held[key] = self._held.get(key, 0) + 1
            self._pending.pop(key, None)
            self.stats.stored += 1
        while len(self._held) > self.max_blocks:
            key = next(iter(self._held))
            del self._held[key]
            self.stats.dropped += 1
        # Engine hashes whose key was dropped above are purged lazily when removed.

    def _removed(self, hashes: Iterable[BlockHash]) -> None:
        for engine_hash in hashes:
            key = self._key_of.pop(engine_hash, None)
            if key is not None:
                self._release(key)
                self._pending.pop(key, None)
                self.stats.removed += 1

    def _release(self, key: int) -> None:
        count = self._held.get(key, 0)
        if count <= 1:
            self._held.pop(key, None)
        else:
            self._held[key] = count - 1

    def clear(self) -> None:
        self._key_of.clear()
        self._held.clear()
        self._pending.clear()
        self.stats.cleared += 1

    # -- this gateway's own decisions -------------------------------------------------------
    def sent(self, keys: Sequence[int], now: float) -> None:
        """This gateway sent a prompt with ``keys`` here: held until events say otherwise."""
        pending = self._pending
        for k in keys:
            if k not in self._held:
                pending[k] = now
        if len(pending) > self.max_blocks:
            self.expire(now)

    def unsent(self, keys: Iterable[int]) -> None:
        """The prompt never reached the engine (the attempt failed)."""
        for k in keys:
            self._pending.pop(k, None)

    def expire(self, now: float) -> None:
        cutoff = now - self.pending_ttl_s
        stale = [k for k, t in self._pending.items() if t < cutoff]
        for k in stale:
            del self._pending[k]
        while len(self._pending) > self.max_blocks:
            del self._pending[next(iter(self._pending))]

    @property
    def pending(self) -> int:
        return len(self._pending)


class ExactIndex:
    """Worker id -> :class:`WorkerBlocks`, for the workers whose events are live."""

    def __init__(self, max_blocks: int = 1 << 20, pending_ttl_s: float = 10.0) -> None:
        self._max_blocks = max_blocks
        self._pending_ttl_s = pending_ttl_s
        self._workers: dict[str, WorkerBlocks] = {}
        self._live: set[str] = set()

    def worker(self, worker_id: str) -> WorkerBlocks:
        blocks = self._workers.get(worker_id)
        if blocks is None:
            blocks = self._workers[worker_id] = WorkerBlocks(
                self._max_blocks, self._pending_ttl_s
            )
        return blocks

    def get(self, worker_id: str) -> WorkerBlocks | None:
        return self._workers.get(worker_id)

    def set_live(self, worker_id: str, live: bool) -> None:
        """Whether routing trusts this worker's events (its feed is connected and in order)."""
        if live:
            self.worker(worker_id)
            self._live.add(worker_id)
        else:
            self._live.discard(worker_id)

    def is_live(self, worker_id: str) -> bool:
        return worker_id in self._live

    @property
    def live(self) -> frozenset[str]:
        return frozenset(self._live)

    def drop(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._live.discard(worker_id)

    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for wid in self._live:
            depth = self._workers[wid].depth(keys, now)
            if depth:
                out[wid] = depth
        return out

    def sent(self, worker_id: str, keys: Sequence[int], now: float) -> None:
        if worker_id in self._live:
            self._workers[worker_id].sent(keys, now)

    def unsent(self, worker_id: str, keys: Iterable[int]) -> None:
        blocks = self._workers.get(worker_id)
        if blocks is not None:
            blocks.unsent(keys)


@dataclass(frozen=True, slots=True)
class ExactMatcher:
    """A :class:`PrefixMatcher`: depths from the exact index for workers with live events,
    from ``base`` (the modelled index) for the rest; heat and churn come from ``base``, which
    records every decision of either kind.

    A prefix that no worker holds at least ``floor`` blocks of (the policy's shortest useful
    match) is cold everywhere; for it the modelled depths stand, stale as they are: they name
    the worker it lived on until it was evicted, which is where its siblings go back to, so
    an evicted prefix returns to its home instead of a new worker each time. :meth:`held`
    answers the exact question (what the prediction of cached tokens uses).
    """

    base: PrefixMatcher
    exact: ExactIndex
    now: float
    floor: int = 1

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        live = self.exact.live
        if not live:
            return self.base.match(blocks)
        modelled = self.base.match(blocks)
        out = {w: d for w, d in modelled.items() if w not in live}
        out.update(self.exact.match(blocks, self.now))
        if any(d >= self.floor for d in out.values()):
            return out
        return modelled

    def held(self, worker_id: str, blocks: Sequence[int]) -> int:
        """Leading blocks ``worker_id`` holds: its events' word when they are live."""
        if self.exact.is_live(worker_id):
            return self.exact.worker(worker_id).depth(blocks, self.now)
        return self.base.match(blocks).get(worker_id, 0)

    def heat(self, block: int) -> float:
        return self.base.heat(block)

    def recent_requests(self, worker_id: str) -> float:
        return self.base.recent_requests(worker_id)

    def mean_new_blocks(self) -> float:
        return self.base.mean_new_blocks()

    def tail_age(self, worker_id: str) -> float:
        return self.base.tail_age(worker_id)
