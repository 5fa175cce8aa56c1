"""The engine-exact index: which token blocks each worker's engine holds, from its events.

One :class:`WorkerBlocks` per worker that publishes KV events: the block keys its engine
reported stored and not yet removed (:mod:`gateway.contracts.kv_keys`), bounded, plus the blocks
this gateway just sent it (*pending*: the engine will store them as it admits the request, and
its events follow a moment later; they stop counting after ``pending_ttl_s`` unless an event
confirms them). AllBlocksCleared, a restart or a gap in the events that cannot be replayed
empties it, and it rebuilds from the events that follow.

Events say what a cache holds now, not what it will hold when a request waiting in the
engine's queue is admitted: when the cache is full, every prompt sent ahead of it evicts
blocks first. So, when the worker's size is known (:meth:`ExactIndex.set_capacity`), the
index anticipates those evictions: it keeps the held blocks in least-recently-used order
(stored by an event or used by a prompt this gateway sent; a prompt's deepest block oldest, as
engines release them), and while held plus pending blocks exceed the size, that many of the
oldest are *doomed*: they do not count as held. The doomed set is recomputed from the current
state, so it corrects itself as the engine's own removals arrive.

:class:`ExactMatcher` puts the index behind the routing's prefix-match interface: for a worker
with a live event feed the depth comes from here, for every other worker from the modelled
index, so both kinds of worker share one pool and one policy. Pure: no I/O, time passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gateway.contracts.kv_keys import chain_from, chain_seed, salt_of
from gateway.contracts.kv_wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from gateway.kvevents.hybrid import Corrections, ModelledSignals, WallClock
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
        self._pending: dict[int, float] = {}  # our key -> when this gateway sent it (in order)
        self.capacity = 0  # the engine's blocks; 0 = unknown: no eviction is anticipated
        self.reserve = 0  # of them, held by running requests (not cached prefixes)
        # Held and pending keys, least recently used first (only kept with a capacity).
        self._lru: dict[int, None] = {}
        self._doomed: frozenset[int] = frozenset()
        self._doomed_at: float | None = None  # when _doomed was computed (None: stale)
        self.stats = BlockStats()
        # The hybrid view's corrections to the modelled index (gateway.kvevents.hybrid).
        self.corrections: Corrections | None = None

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, key: int, now: float) -> bool:
        if key in self._held and key not in self.doomed(now):
            return True
        sent = self._pending.get(key)
        return sent is not None and now - sent <= self.pending_ttl_s

    def doomed(self, now: float) -> frozenset[int]:
        """Held blocks that the prompts sent here will have evicted by the time they run."""
        if self._doomed_at == now:
            return self._doomed
        self.expire(now)
        doomed: frozenset[int] = frozenset()
        if self.capacity:
            held, pending = self._held, self._pending
            over = (len(held) + sum(1 for k in pending if k not in held) + self.reserve
                    - self.capacity)
            if over > 0:
                evictable = (k for k in self._lru if k in held and k not in pending)
                doomed = frozenset(itertools.islice(evictable, over))
        self._doomed, self._doomed_at = doomed, now
        return doomed

    def depth(self, keys: Sequence[int], now: float) -> int:
        """Leading keys of ``keys`` this worker holds (or will, for those just sent here;
        not those the prompts sent ahead will have evicted)."""
        held, pending, ttl = self._held, self._pending, self.pending_ttl_s
        doomed = self.doomed(now) if self.capacity else frozenset()
        n = 0
        for k in keys:
            if k in held and k not in doomed:
                n += 1
                continue
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
    def begin_batch(self, ts: float, now: float) -> None:
        """The events that follow came in one batch, published at ``ts`` (wall clock)."""
        if self.corrections is not None:
            self.corrections.begin(ts, now)

    def end_batch(self) -> None:
        if self.corrections is not None:
            self.corrections.end()

    def apply(self, event: Event, now: float = 0.0) -> None:
        """One event, as it arrives at ``now`` (the clock of this gateway's decisions)."""
        if isinstance(event, BlockStored):
            self._stored(event, now)
        elif isinstance(event, BlockRemoved):
            self._removed(event.block_hashes, now)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def _stored(self, event: BlockStored, now: float) -> None:
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
        fix = self.corrections
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
            if fix is not None:
                fix.stored(key, now)
        if self.capacity:
            lru = self._lru
            for key in reversed(keys[: len(event.block_hashes)]):  # deepest oldest
                if key not in lru:  # a prompt sent here has its place since it was sent
                    lru[key] = None
        self._doomed_at = None
        while len(self._held) > self.max_blocks:
            key = next(iter(self._held))
            del self._held[key]
            self._lru.pop(key, None)
            self.stats.dropped += 1
        # Engine hashes whose key was dropped above are purged lazily when removed.

    def _removed(self, hashes: Iterable[BlockHash], now: float) -> None:
        fix = self.corrections
        for engine_hash in hashes:
            key = self._key_of.pop(engine_hash, None)
            if key is not None:
                self._release(key)
                self._pending.pop(key, None)
                if key not in self._held:
                    self._lru.pop(key, None)
                    if fix is not None:
                        fix.removed(key, now)
                self.stats.removed += 1
        self._doomed_at = None

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
        self._lru.clear()
        self._doomed_at = None
        self.stats.cleared += 1
        if self.corrections is not None:
            self.corrections.cleared()

    # -- this gateway's own decisions -------------------------------------------------------
    def sent(self, keys: Sequence[int], now: float, reserve: int | None = None) -> None:
        """This gateway sent a prompt with ``keys`` here: held until events say otherwise;
        the blocks it already holds become the most recently used. ``reserve``: blocks the
        engine's running requests hold besides cached prefixes (unchanged when None)."""
        if reserve is not None:
            self.reserve = reserve
        held, pending, lru = self._held, self._pending, self._lru
        # Deepest first, as engines release a finished request's blocks: a prefix's first
        # blocks are the last of it to be evicted.
        for k in reversed(keys):
            if self.capacity:
                lru.pop(k, None)
                lru[k] = None  # used now: newest last
            if k not in held:
                pending.pop(k, None)
                pending[k] = now  # in time order
        self._doomed_at = None
        if len(pending) > self.max_blocks:
            self.expire(now)

    def unsent(self, keys: Iterable[int]) -> None:
        """The prompt never reached the engine (the attempt failed)."""
        for k in keys:
            self._pending.pop(k, None)
            if k not in self._held:
                self._lru.pop(k, None)
        self._doomed_at = None

    def expire(self, now: float) -> None:
        """Forget sends older than ``pending_ttl_s`` (kept in time order), and the oldest
        beyond the bound."""
        pending, cutoff = self._pending, now - self.pending_ttl_s
        while pending:
            oldest = next(iter(pending))
            if pending[oldest] >= cutoff and len(pending) <= self.max_blocks:
                break
            del pending[oldest]
            if oldest not in self._held:
                self._lru.pop(oldest, None)

    @property
    def pending(self) -> int:
        return len(self._pending)


class ExactIndex:
    """Worker id -> :class:`WorkerBlocks`, for the workers whose events are live."""

    def __init__(
        self,
        max_blocks: int = 1 << 20,
        pending_ttl_s: float = 10.0,
        settle_s: float = 2.0,
        skew_s: float = 0.005,
        hybrid: bool = True,
    ) -> None:
        self._max_blocks = max_blocks
        self._pending_ttl_s = pending_ttl_s
        self._settle_s = settle_s
        self._skew_s = skew_s
        self.clock = WallClock()  # the decision clock -> the events' (set by the owner)
        self.hybrid = hybrid  # keep the hybrid view's corrections (gateway.kvevents.hybrid)
        self._workers: dict[str, WorkerBlocks] = {}
        self._live: set[str] = set()
        self._capacity: dict[str, int] = {}
        # The hybrid view (gateway.kvevents.hybrid): blocks stored by someone else -> workers,
        # and the modelled index's answers it needs (set by the owner; None: not known).
        self._foreign: dict[int, set[str]] = {}
        self.model_holds: Callable[[str, int], bool] | None = None
        self.on_reset: Callable[[str, Callable[[int], bool]], None] | None = None
        # Worker -> applies what its engine published up to now (set by its feed).
        self._refresh: dict[str, Callable[[], None]] = {}

    def worker(self, worker_id: str) -> WorkerBlocks:
        blocks = self._workers.get(worker_id)
        if blocks is None:
            blocks = self._workers[worker_id] = WorkerBlocks(
                self._max_blocks, self._pending_ttl_s
            )
            blocks.capacity = self._capacity.get(worker_id, 0)
            if self.hybrid:
                blocks.corrections = Corrections(
                    worker_id, self._foreign, self._model_holds, self._reset, self.clock,
                    skew_s=self._skew_s, settle_s=self._settle_s, max_blocks=self._max_blocks,
                )
        return blocks

    def _model_holds(self, worker_id: str, key: int) -> bool | None:
        holds = self.model_holds
        return None if holds is None else holds(worker_id, key)

    def _reset(self, worker_id: str, keep: Callable[[int], bool]) -> None:
        if self.on_reset is not None:
            self.on_reset(worker_id, keep)

    def set_refresh(self, worker_id: str, refresh: Callable[[], None] | None) -> None:
        """``refresh`` brings the worker's blocks up to what its engine published so far."""
        if refresh is None:
            self._refresh.pop(worker_id, None)
        else:
            self._refresh[worker_id] = refresh

    def refresh(self, worker_id: str) -> None:
        """Apply the worker's events published up to now (a decision is about to read them)."""
        refresh = self._refresh.get(worker_id)
        if refresh is not None:
            refresh()

    def corrections(self, worker_id: str) -> Corrections | None:
        blocks = self._workers.get(worker_id)
        return blocks.corrections if blocks is not None else None

    def foreign_holders(self, key: int) -> set[str]:
        return self._foreign.get(key) or set()

    def set_capacity(self, worker_id: str, blocks: int) -> None:
        """The worker's engine holds ``blocks`` blocks (0: unknown)."""
        self._capacity[worker_id] = blocks
        known = self._workers.get(worker_id)
        if known is not None:
            known.capacity = blocks

    def capacity(self, worker_id: str) -> int:
        """The worker's engine blocks as reported (0: unknown)."""
        return self._capacity.get(worker_id, 0)

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

    @property
    def has_live(self) -> bool:
        return bool(self._live)

    def drop(self, worker_id: str) -> None:
        blocks = self._workers.pop(worker_id, None)
        if blocks is not None and blocks.corrections is not None:
            blocks.corrections.dropped()
        self._live.discard(worker_id)
        self._capacity.pop(worker_id, None)

    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for wid in list(self._live):
            self.refresh(wid)
            if wid not in self._live:
                continue
            depth = self._workers[wid].depth(keys, now)
            if depth:
                out[wid] = depth
        return out

    def sent(
        self, worker_id: str, keys: Sequence[int], now: float, reserve: int | None = None
    ) -> None:
        blocks = self._workers.get(worker_id)
        if blocks is None:
            return
        if blocks.corrections is not None:
            blocks.corrections.sent(keys, now)
        elif worker_id in self._live:
            # The events view's own record of what is on its way (the hybrid view has the
            # modelled index for that).
            blocks.sent(keys, now, reserve)

    def unsent(self, worker_id: str, keys: Iterable[int]) -> None:
        blocks = self._workers.get(worker_id)
        if blocks is not None:
            blocks.unsent(keys)

    def done(self, worker_id: str, keys: Sequence[int], now: float) -> None:
        """The request that carried ``keys`` to the worker ended (however it ended)."""
        fix = self.corrections(worker_id)
        if fix is not None:
            fix.done(keys, now)


@dataclass(frozen=True, slots=True)
class ExactMatcher(ModelledSignals):
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
            self.exact.refresh(worker_id)
            return self.exact.worker(worker_id).depth(blocks, self.now)
        return self.base.match(blocks).get(worker_id, 0)

