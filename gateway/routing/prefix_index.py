"""In-process index of which workers hold which prefixes: block hash -> holders.

Recorded at decision time (the gateway sends a prompt to a worker, so that worker will hold its
blocks a moment later), and from other gateway replicas through the metadata store. Because
block hashes are chained, holding block ``i`` of a prompt means holding its whole prefix, and
the longest match of a worker is found by walking the chain from the first block until the
worker no longer appears.

The index models each worker's cache as an LRU of ``capacity`` blocks, the worker's real cache
size when it is known (:meth:`set_capacity`): a prefix the worker has surely evicted by now stops
counting as held, and a prompt's first blocks are kept longest (they are recorded last, so they
are the most recently used), as in the worker's own cache. Entries also expire after ``ttl_s``.
Time is an argument of every call that depends on it (``now``, seconds on any monotonic
origin), so the simulator replays traces on its own clock; :meth:`at` binds one instant for
the routing policies (:class:`IndexView`).

It also keeps each worker's recent *churn*, which the cold-placement picker balances
(:mod:`gateway.routing.policies.spread_picker`): requests recorded for it and blocks they added
(decayed with the same half-life as the heat), and the age of its least recently used block
once its modelled cache is full. A worker whose oldest block is young is evicting prefixes that
were used moments ago, so a new prefix placed there pushes out something likely to come back.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Churn:
    """Requests recorded for a worker and the blocks they added, decayed; ``at`` = last update."""

    requests: float = 0.0
    new_blocks: float = 0.0
    at: float = 0.0


class PrefixIndex:
    def __init__(
        self, capacity: int = 1_000_000, ttl_s: float = 600.0, heat_half_life_s: float = 30.0
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._half_life = heat_half_life_s
        # block hash -> (requests that contained it, decayed; time of the last update)
        self._heat: dict[int, tuple[float, float]] = {}
        self._default_capacity = capacity
        self._ttl_s = ttl_s
        # block hash -> {worker id: time recorded}
        self._holders: dict[int, dict[str, float]] = {}
        # worker id -> its blocks, least recently used first
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        # worker id -> its recent requests and the blocks they added, decayed; and all workers
        self._churn: dict[str, Churn] = {}
        self._pool_churn = Churn()

    def __len__(self) -> int:
        return len(self._holders)

    def at(self, now: float) -> IndexView:
        """The read side at one instant, as routing policies see it."""
        return IndexView(self, now)

    def capacity(self, worker_id: str) -> int:
        return self._capacity.get(worker_id, self._default_capacity)

    def set_capacity(self, worker_id: str, blocks: int) -> None:
        """How many blocks ``worker_id`` can hold; its least recently used excess is dropped."""
        self._capacity[worker_id] = max(1, blocks)
        self._trim(worker_id)

    def held_blocks(self, worker_id: str) -> int:
        lru = self._lru.get(worker_id)
        return len(lru) if lru is not None else 0

    def record(self, blocks: Sequence[int], worker_id: str, now: float) -> None:
        """``worker_id`` holds every block of ``blocks`` from ``now`` on."""
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        holders_of = self._holders
        heat = self._heat
        new = 0
        # Deepest first, so the head of the prompt ends up most recently used.
        for h in reversed(blocks):
            if h not in lru:
                new += 1
            value, at = heat.get(h, (0.0, now))
            heat[h] = (self._decayed(value, at, now) + 1.0, now)
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = {worker_id: now}
            else:
                holders[worker_id] = now
            lru[h] = None
            lru.move_to_end(h)
        self._trim(worker_id)
        churn = self._churn.get(worker_id)
        if churn is None:
            churn = self._churn[worker_id] = Churn(at=now)
        self._count(churn, new, now)
        self._count(self._pool_churn, new, now)

    def _count(self, churn: Churn, new_blocks: int, now: float) -> None:
        keep = self._decay_factor(churn.at, now)
        churn.requests = churn.requests * keep + 1.0
        churn.new_blocks = churn.new_blocks * keep + new_blocks
        churn.at = now

    def _trim(self, worker_id: str) -> None:
        lru = self._lru.get(worker_id)
        if lru is None:
            return
        excess = len(lru) - self.capacity(worker_id)
        for _ in range(max(0, excess)):
            h, _ = lru.popitem(last=False)
            self._drop(h, worker_id)

    def _drop(self, h: int, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.pop(worker_id, None)
            if not holders:
                del self._holders[h]
                self._heat.pop(h, None)

    def _decay_factor(self, at: float, now: float) -> float:
        if self._half_life <= 0 or now <= at:
            return 1.0
        return float(0.5 ** ((now - at) / self._half_life))

    def _decayed(self, value: float, at: float, now: float) -> float:
        return value * self._decay_factor(at, now)

    def recent_requests(self, worker_id: str, now: float) -> float:
        """Requests recorded for ``worker_id``, halved every ``heat_half_life_s``."""
        churn = self._churn.get(worker_id)
        return churn.requests * self._decay_factor(churn.at, now) if churn is not None else 0.0

    def mean_new_blocks(self) -> float:
        """Blocks a recorded request added to its worker's cache, on average over all workers
        (recent requests weigh more); 0 before the first record."""
        churn = self._pool_churn
        return churn.new_blocks / churn.requests if churn.requests > 0 else 0.0

    def tail_age(self, worker_id: str, now: float) -> float:
        """Seconds since the least recently used block of ``worker_id`` was recorded, once its
        modelled cache is full (the next block recorded evicts it); ``inf`` while it has room."""
        lru = self._lru.get(worker_id)
        if lru is None or len(lru) < self.capacity(worker_id):
            return math.inf
        oldest = next(iter(lru))
        return max(0.0, now - self._holders[oldest][worker_id])

    def heat(self, block: int, now: float) -> float:
        """How many recorded requests contained ``block``, halved every ``heat_half_life_s``:
        a system prompt many users send is hot, one conversation's history is not."""
        value, at = self._heat.get(block, (0.0, now))
        return self._decayed(value, at, now)

    def match(self, blocks: Sequence[int], now: float) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``blocks`` it holds (only those > 0)."""
        cutoff = now - self._ttl_s
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(blocks):
            holders = self._holders.get(h)
            if not holders:
                break
            fresh = {w for w, t in holders.items() if t >= cutoff}
            alive = fresh if alive is None else alive & fresh
            if not alive:
                break
            for w in alive:
                depth[w] = i + 1
        return depth

    def forget(self, worker_id: str, blocks: Iterable[int]) -> None:
        """``worker_id`` no longer holds ``blocks`` (a prediction it answered with a miss)."""
        lru = self._lru.get(worker_id)
        if lru is None:
            return
        for h in blocks:
            if lru.pop(h, 0) is None:
                self._drop(h, worker_id)

    def shed(self, worker_id: str, fraction: float) -> int:
        """Drop the least recently used ``fraction`` of a worker's blocks; returns how many."""
        lru = self._lru.get(worker_id)
        if lru is None:
            return 0
        count = int(len(lru) * min(1.0, max(0.0, fraction)))
        for _ in range(count):
            h, _ = lru.popitem(last=False)
            self._drop(h, worker_id)
        return count

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that left or restarted (its cache is gone with it)."""
        for h in self._lru.pop(worker_id, OrderedDict()):
            self._drop(h, worker_id)
        self._churn.pop(worker_id, None)


@dataclass(frozen=True, slots=True)
class IndexView:
    """A :class:`PrefixIndex` read at one instant: the ``PrefixMatcher`` routing policies see."""

    index: PrefixIndex
    now: float

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        return self.index.match(blocks, self.now)

    def heat(self, block: int) -> float:
        return self.index.heat(block, self.now)

    def recent_requests(self, worker_id: str) -> float:
        return self.index.recent_requests(worker_id, self.now)

    def mean_new_blocks(self) -> float:
        return self.index.mean_new_blocks()

    def tail_age(self, worker_id: str) -> float:
        return self.index.tail_age(worker_id, self.now)
