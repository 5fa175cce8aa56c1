"""In-process index of which workers hold which prefixes: a tree of prefix checkpoints.

Recorded at decision time (the gateway sends a prompt to a worker, so that worker will hold its
blocks a moment later), and from other gateway replicas through the metadata store. A prompt is
known by its checkpoint hashes (:class:`gateway.fingerprint.PrefixKey`): hash ``i`` names the
whole prefix of ``depths[i]`` blocks, so the checkpoints of all recorded prompts form a tree
(each node's parent is the checkpoint before it) and what one worker holds is a subtree that
contains the root side of every path it holds: if it holds a checkpoint it holds the ones
before it. That makes every question a binary search over the request's checkpoints:

* :meth:`PrefixIndex.match`: per worker, the deepest checkpoint it holds, in
  O(distinct depths x log checkpoints) lookups, never a walk over the known part of the prompt;
* :meth:`PrefixIndex.record`: finds what the worker already holds the same way and adds only
  the checkpoints past it, so recording costs what the request adds, not its length.

The index models each worker's cache as an LRU of ``capacity`` blocks (its real cache size when
known: :meth:`set_capacity`), counting each prompt's real length in blocks. Recency follows the
worker's own cache: using a prefix uses everything before it, so only the deepest checkpoint of
a request is touched and a checkpoint is as recent as the newest use of anything below it. The
least recently used *leaf* (a held checkpoint with no held checkpoint below it) is evicted
first, then its parent once that becomes a leaf: a prompt's tail goes before its head, as in
vLLM's prefix cache. Entries unused for ``ttl_s`` expire the same way.

Time is an argument of every call that depends on it (``now``, seconds on any monotonic
origin), so the simulator replays traces on its own clock; :meth:`at` binds one instant for the
routing policies (:class:`IndexView`).

Where prompts part, it learns what later prompts do with the part past the *fork* (the deepest
prefix known when a prompt went on along a new path): a session's next turn *extends* it (goes
on from its end), a question on a shared document *reuses* it (goes on from inside).
:meth:`PrefixIndex.branches_grow` tells the routing policy which of the two a fork's branches
are (O(1) per record: the deepest known checkpoint is already found).

Prompts that extend each other (each a session's next turn) form a *session*; the index keeps
each session's recently routed blocks, so that the routing policy can tell a worker loaded by
one long session from one loaded by many small ones (:meth:`PrefixIndex.session_blocks`).

It also keeps each worker's recent *churn*, which the cold-placement picker balances
(:mod:`gateway.routing.policies.spread_picker`): requests recorded for it and blocks they added
(decayed with the same half-life as the heat), and the age of its least recently used block
once its modelled cache is full. A worker whose oldest block is young is evicting prefixes that
were used moments ago, so a new prefix placed there pushes out something likely to come back.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.values import value


@dataclass(slots=True)
class Churn:
    """Requests recorded for a worker and the blocks they added, decayed; ``at`` = last update."""

    requests: float = 0.0
    new_blocks: float = 0.0
    routed_blocks: float = 0.0  # whole prompts, cached part included
    at: float = 0.0


@dataclass(slots=True)
class _Hold:
    """One worker's hold on one checkpoint. ``seq``/``at``: its last use (for a leaf, the
    newest use of anything below it too); ``children``: held checkpoints right below it."""

    seq: int
    at: float
    children: int = 0


@dataclass(slots=True)
class _Node:
    parent: int | None
    depth: int  # blocks
    holders: dict[str, _Hold] = field(default_factory=dict)
    heat: float = 0.0
    heat_at: float = 0.0
    # The prompt that added this checkpoint: its length in blocks, and the fork it went on
    # from (the deepest prefix known before it, or for a prompt that extended another, that
    # prompt's fork; None for the first prompt on its path and the prompts extending it).
    end: int = 0
    fork: int | None = None
    session: int = 0  # the chain of prompts extending each other that added it


@dataclass(slots=True)
class _Fork:
    """What later prompts did with the prompts that went on from one fork, decayed:
    ``extended``, went on from the end of one (a session's next turn); ``reused``, went on
    from inside one (another request sharing part of what came after the fork)."""

    extended: float = 0.0
    reused: float = 0.0
    at: float = 0.0


@dataclass(slots=True)
class _Cache:
    """The modelled cache of one worker."""

    held: int = 0  # blocks
    nodes: set[int] = field(default_factory=set)
    leaves: list[tuple[int, int]] = field(default_factory=list)  # heap of (seq, node hash)
    churn: Churn = field(default_factory=Churn)


class PrefixIndex:
    def __init__(
        self, capacity: int = 1_000_000, ttl_s: float = 600.0, heat_half_life_s: float = 30.0
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._half_life = heat_half_life_s
        self._default_capacity = capacity
        self._ttl_s = ttl_s
        self._nodes: dict[int, _Node] = {}
        self._caches: dict[str, _Cache] = {}
        self._capacity: dict[str, int] = {}
        self._pool_churn = Churn()
        self._forks: dict[int, _Fork] = {}
        self._pool_forks = _Fork()
        self._seq = 0
        self._swept_at = -math.inf
        # Session -> its recent requests and routed blocks, in order of last use.
        self._sessions: dict[int, Churn] = {}
        self._next_session = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def at(self, now: float) -> IndexView:
        """The read side at one instant, as routing policies see it."""
        return IndexView(self, now)

    def capacity(self, worker_id: str) -> int:
        return self._capacity.get(worker_id, self._default_capacity)

    def learnt(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s capacity was set (else it is the default)."""
        return worker_id in self._capacity

    def set_capacity(self, worker_id: str, blocks: int) -> None:
        """How many blocks ``worker_id`` can hold; its least recently used excess is dropped."""
        self._capacity[worker_id] = max(1, blocks)
        self._trim(worker_id, self.capacity(worker_id))

    def held_blocks(self, worker_id: str) -> int:
        cache = self._caches.get(worker_id)
        return cache.held if cache is not None else 0

    def fill(self, worker_id: str) -> float:
        """Share of ``worker_id``'s modelled cache in use: 0 when empty, 1 once full."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0.0
        return min(1.0, cache.held / self._capacity.get(worker_id, self._default_capacity))

    # -- lookups ------------------------------------------------------------------------------

    def holds(self, worker_id: str, block: int) -> bool:
        """Whether ``worker_id`` holds the prefix ``block`` names (one dict lookup)."""
        node = self._nodes.get(block)
        return node is not None and worker_id in node.holders

    def _held_count(self, blocks: Sequence[int], worker_id: str, hi: int) -> int:
        """How many leading checkpoints of ``blocks[:hi]`` ``worker_id`` holds."""
        nodes = self._nodes
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            node = nodes.get(blocks[mid - 1])
            if node is not None and worker_id in node.holders:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _known_count(self, blocks: Sequence[int], hi: int, skip: dict[str, int]) -> int:
        """How many leading checkpoints of ``blocks[:hi]`` some worker not in ``skip`` holds."""
        nodes = self._nodes
        lo = 0
        if not skip:  # every node has a holder (the last hold to go takes its node along)
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if blocks[mid - 1] in nodes:
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            node = nodes.get(blocks[mid - 1])
            if node is not None and not node.holders.keys() <= skip.keys():
                lo = mid
            else:
                hi = mid - 1
        return lo

    def match(self, blocks: Sequence[int], now: float) -> dict[str, int]:
        """Worker id -> number of leading checkpoints of ``blocks`` it holds (only those > 0)."""
        self._expire(now)
        found: dict[str, int] = {}
        hi = len(blocks)
        while hi > 0:
            count = self._known_count(blocks, hi, found)
            if count == 0:
                break
            for wid in self._nodes[blocks[count - 1]].holders:
                if wid not in found:
                    found[wid] = count
            hi = count - 1
        return found

    def heat(self, block: int, now: float) -> float:
        """How many recorded requests shared the prefix ``block`` names (as their deepest known
        part, or as their end), halved every ``heat_half_life_s``: a system prompt many users
        send is hot, one conversation's history is not."""
        node = self._nodes.get(block)
        if node is None:
            return 0.0
        return node.heat * self._decay_factor(node.heat_at, now)

    def branched(self, block: int) -> bool:
        """Whether some worker holds a checkpoint right below the prefix ``block`` names: a
        recorded prompt went on past it. For the deepest prefix of a request that some worker
        holds, that continuation is another prompt's, so the prefix is a trunk the request
        branches from (a shared system or tool prompt), not the end of a prompt it extends."""
        node = self._nodes.get(block)
        return node is not None and any(hold.children for hold in node.holders.values())

    def extends(self, block: int, depth: int) -> bool:
        """Whether a prompt that goes on past the prefix ``block`` names to its next checkpoint
        at ``depth`` blocks *extends* the prompt that recorded that prefix (goes on from its
        end, as a session's next turn does) rather than sharing it from inside (as another
        question on a shared document or system prompt does)."""
        node = self._nodes.get(block)
        return node is not None and depth > node.end

    def branches_grow(self, block: int, unseen: bool | None = None) -> bool:
        """Whether the prompts that went on from the fork ``block`` names grow: later prompts
        extended them (went on from the end of one, as a session's next turn does) at least
        as often as they reused them (went on from inside one, as requests sharing a document
        after a system prompt do). A fork with no such record yet is ``unseen``, or with None
        taken to be like the pool's forks so far (true before anything is seen)."""
        stats = self._forks.get(block)
        if stats is None or stats.extended + stats.reused == 0.0:
            if unseen is not None:
                return unseen
            stats = self._pool_forks
        return stats.extended >= stats.reused

    # -- writes -------------------------------------------------------------------------------

    def record(
        self, blocks: Sequence[int], worker_id: str, now: float, depths: Sequence[int] = ()
    ) -> None:
        """``worker_id`` holds the prefixes ``blocks`` name from ``now`` on; ``depths[i]`` is
        the depth in blocks of ``blocks[i]`` (empty: ``i + 1``, every block a checkpoint)."""
        n = len(blocks)
        if n == 0:
            return
        self._expire(now)
        cache = self._caches.get(worker_id)
        if cache is None:
            cache = self._caches[worker_id] = _Cache(churn=Churn(at=now))
        nodes = self._nodes
        self._seq += 1
        seq = self._seq
        held = self._held_count(blocks, worker_id, n)
        shared = max(held, self._known_count(blocks, n, {}))
        total = depths[n - 1] if depths else n
        fork: int | None = None
        session = -1  # a prompt that extends the one that added ``known`` continues its session
        if shared:
            known = nodes[blocks[shared - 1]]
            self._heat_up(known, now)
            if shared < n:
                after = depths[shared] if depths else shared + 1
                if after > known.end:
                    session = known.session
                fork = self._went_on(known, blocks[shared - 1], after, now)
            else:
                session = known.session
        if session < 0:
            session = self._next_session
            self._next_session += 1
        parent = blocks[held - 1] if held else None
        if parent is not None and held < n:
            nodes[parent].holders[worker_id].children += 1
        added = n - held
        if added:
            # The checkpoints past what the worker holds: a chain, each the parent of the next
            # (one loop of dict and slot writes per block; the last one is a leaf).
            hold = None
            for i in range(held, n):
                h = blocks[i]
                hold = _Hold(seq, now, 1)
                node = nodes.get(h)
                if node is None:
                    nodes[h] = _Node(parent, depths[i] if depths else i + 1, {worker_id: hold},
                                     0.0, 0.0, total, fork, session)
                else:
                    node.holders[worker_id] = hold
                parent = h
            assert hold is not None
            hold.children = 0
            cache.nodes.update(blocks[held:])
        last = nodes[blocks[n - 1]]
        if held == n:  # already held: this is a use of it
            hold = last.holders[worker_id]
            hold.seq, hold.at = seq, now
        if shared < n:
            self._heat_up(last, now)
        before = (depths[held - 1] if depths else held) if held else 0
        new_blocks = last.depth - before if added else 0
        cache.held += new_blocks
        if last.holders[worker_id].children == 0:
            heapq.heappush(cache.leaves, (seq, blocks[n - 1]))
        self._trim(worker_id, self.capacity(worker_id))
        self._count(cache.churn, new_blocks, total, now)
        self._count(self._pool_churn, new_blocks, total, now)
        churn = self._sessions.pop(session, None) or Churn(at=now)
        self._sessions[session] = churn  # re-inserted: the dict stays in order of last use
        self._count(churn, new_blocks, total, now)

    def _went_on(self, known: _Node, block: int, after: int, now: float) -> int | None:
        """A prompt went on past ``known`` (its deepest known prefix, named ``block``) to its
        next checkpoint at depth ``after``; returns the fork of the prompt being recorded.

        It *extends* the prompt that added ``known`` when that checkpoint is past that one's
        end (``known`` is that end, or where checkpoints are sparse, the last one of both
        before it): it goes on from the same fork, and the fork is told. Otherwise
        ``block`` is its fork; when ``block`` was no fork before, the prompt that added
        ``known`` was *reused* from inside, and that prompt's fork is told. Going on from a
        known fork (a new session off a shared system prompt) is neither, and so is going on
        from the first prompt on a path (which went on from no fork): that finds a fork."""
        if after > known.end:
            if known.fork is not None:
                self._tally(known.fork, True, now)
            return known.fork
        if block not in self._forks:
            if known.fork is not None:
                self._tally(known.fork, False, now)
            self._forks[block] = _Fork(at=now)
        return block

    def _tally(self, fork: int, extended: bool, now: float) -> None:
        stats = self._forks.get(fork)
        if stats is None and fork in self._nodes:
            stats = self._forks[fork] = _Fork(at=now)
        for s in (stats, self._pool_forks):
            if s is not None:
                keep = self._decay_factor(s.at, now)
                s.extended = s.extended * keep + extended
                s.reused = s.reused * keep + (not extended)
                s.at = now

    def _heat_up(self, node: _Node | None, now: float) -> None:
        if node is not None:
            node.heat = node.heat * self._decay_factor(node.heat_at, now) + 1.0
            node.heat_at = now

    def last_use(self, worker_id: str, block: int) -> int:
        """When ``worker_id`` last used the prefix ``block`` names, as a sequence number of
        the index's records (0: not held). Exact for the end of a recorded prompt (a leaf); for
        a prefix others went on past, the use that made it a leaf (earlier, never later)."""
        node = self._nodes.get(block)
        hold = node.holders.get(worker_id) if node is not None else None
        return hold.seq if hold is not None else 0

    def evict_used_before(self, worker_id: str, seq: int, floor: int = 0) -> int:
        """``worker_id`` evicted a prefix it last used at ``seq``: an LRU cache evicts what it
        used less recently first, so drop those, least recently used first, as far as
        ``floor`` blocks left. Returns the blocks it is modelled to hold then."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0
        while cache.held > floor:
            oldest = self._oldest_leaf(cache, worker_id)
            if oldest is None or oldest[1].seq > seq:
                break
            self._evict(worker_id, oldest[0])
        return cache.held

    def forget(self, worker_id: str, blocks: Sequence[int], keep: int = 0) -> None:
        """``worker_id`` does not hold ``blocks[keep:]`` (a prediction that did not happen):
        its holds on them go, deepest first, as far as nothing below them is held."""
        for h in reversed(blocks[keep:]):
            node = self._nodes.get(h)
            hold = node.holders.get(worker_id) if node is not None else None
            if hold is None:
                continue
            if hold.children:
                break
            self._evict(worker_id, h)

    def shed(self, worker_id: str, fraction: float) -> int:
        """Drop the least recently used ``fraction`` of a worker's blocks; returns how many."""
        held = self.held_blocks(worker_id)
        target = held - int(held * min(1.0, max(0.0, fraction)))
        self._trim(worker_id, target)
        return held - self.held_blocks(worker_id)

    def retain(self, worker_id: str, keep: Callable[[int], bool]) -> None:
        """Drop the holds of ``worker_id`` on the prefixes ``keep`` rejects (its cache was
        emptied, but for what was sent there since). ``keep`` accepts a prefix's ancestors
        whenever it accepts the prefix. O(blocks the worker holds)."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return
        nodes = self._nodes
        doomed = [h for h in cache.nodes if not keep(h)]
        doomed.sort(key=lambda h: nodes[h].depth, reverse=True)  # leaves before their parents
        for h in doomed:
            node = nodes.get(h)
            if node is not None and worker_id in node.holders:
                self._evict(worker_id, h)

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that left or restarted (its cache is gone with it)."""
        cache = self._caches.pop(worker_id, None)
        if cache is None:
            return
        for h in cache.nodes:
            node = self._nodes.get(h)
            if node is not None:
                node.holders.pop(worker_id, None)
                if not node.holders:
                    del self._nodes[h]
                    self._forks.pop(h, None)

    # -- eviction -----------------------------------------------------------------------------

    def _oldest_leaf(self, cache: _Cache, worker_id: str) -> tuple[int, _Hold] | None:
        """The least recently used leaf of a worker (stale heap entries are dropped)."""
        leaves = cache.leaves
        nodes = self._nodes
        while leaves:
            seq, h = leaves[0]
            node = nodes.get(h)
            hold = node.holders.get(worker_id) if node is not None else None
            if hold is not None and hold.children == 0 and hold.seq == seq:
                return h, hold
            heapq.heappop(leaves)
        return None

    def _evict(self, worker_id: str, h: int) -> None:
        """Drop the hold of ``worker_id`` on leaf ``h``; its parent may become a leaf, as
        recent as the newest use below it. (:meth:`_trim` evicts the same way, inline.)"""
        nodes = self._nodes
        node = nodes[h]
        hold = node.holders.pop(worker_id)
        cache = self._caches[worker_id]
        cache.nodes.discard(h)
        parent = nodes.get(node.parent) if node.parent is not None else None
        cache.held -= node.depth - (parent.depth if parent is not None else 0)
        if not node.holders:
            del nodes[h]
            self._forks.pop(h, None)
        up = parent.holders.get(worker_id) if parent is not None else None
        if up is not None and node.parent is not None:
            up.children -= 1
            if up.children == 0:  # a leaf now
                up.seq = max(up.seq, hold.seq)
                up.at = max(up.at, hold.at)
                heapq.heappush(cache.leaves, (up.seq, node.parent))

    def _trim(self, worker_id: str, limit: int) -> None:
        """Evict ``worker_id``'s least recently used leaves until it holds ``limit`` blocks.

        :meth:`_evict`, inlined, and chained: a parent that becomes a leaf no more recent than
        the leaf just evicted is the least recently used leaf now (no two leaves share a use),
        so it is evicted next without a round through the heap; a prompt's tail goes block
        after block that way. A request that adds a long prompt evicts as many blocks, each
        one a pass of this loop, so the loop keeps to local names."""
        cache = self._caches.get(worker_id)
        if cache is None or cache.held <= limit:
            return
        nodes = self._nodes
        forks = self._forks
        cache_nodes = cache.nodes
        held = cache.held
        following: int | None = None  # the next leaf to evict, known without the heap
        while held > limit:
            if following is None:
                oldest = self._oldest_leaf(cache, worker_id)
                if oldest is None:
                    break
                following = oldest[0]
            h = following
            following = None
            node = nodes[h]
            holders = node.holders
            hold = holders.pop(worker_id)
            cache_nodes.discard(h)
            up_id = node.parent
            parent = nodes.get(up_id) if up_id is not None else None
            held -= node.depth - (parent.depth if parent is not None else 0)
            if not holders:
                del nodes[h]
                forks.pop(h, None)
            if parent is None or up_id is None:
                continue
            up = parent.holders.get(worker_id)
            if up is None:
                continue
            up.children -= 1
            if up.children == 0:  # a leaf now, as recent as the newest use below it
                if up.seq <= hold.seq:
                    up.seq = hold.seq
                    if hold.at > up.at:
                        up.at = hold.at
                    following = up_id  # the least recently used leaf now: evicted next
                else:
                    if hold.at > up.at:
                        up.at = hold.at
                    heapq.heappush(cache.leaves, (up.seq, up_id))
        cache.held = held
        if following is not None:  # not evicted after all: a leaf like any other
            heapq.heappush(cache.leaves, (nodes[following].holders[worker_id].seq, following))

    def _expire(self, now: float) -> None:
        """Drop entries unused for ``ttl_s`` (checked every ``ttl_s / 64`` at most)."""
        if now - self._swept_at < self._ttl_s / 64:
            return
        self._swept_at = now
        cutoff = now - self._ttl_s
        sessions = self._sessions
        while sessions:
            session, churn = next(iter(sessions.items()))
            if churn.at >= cutoff:
                break
            del sessions[session]
        for wid, cache in self._caches.items():
            while (oldest := self._oldest_leaf(cache, wid)) is not None and oldest[1].at < cutoff:
                self._evict(wid, oldest[0])

    # -- churn --------------------------------------------------------------------------------

    def _count(self, churn: Churn, new_blocks: int, routed: int, now: float) -> None:
        keep = self._decay_factor(churn.at, now)
        churn.requests = churn.requests * keep + 1.0
        churn.new_blocks = churn.new_blocks * keep + new_blocks
        churn.routed_blocks = churn.routed_blocks * keep + routed
        churn.at = now

    def _decay_factor(self, at: float, now: float) -> float:
        if self._half_life <= 0 or now <= at:
            return 1.0
        return float(0.5 ** ((now - at) / self._half_life))

    def recent_requests(self, worker_id: str, now: float) -> float:
        """Requests recorded for ``worker_id``, halved every ``heat_half_life_s``."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0.0
        return cache.churn.requests * self._decay_factor(cache.churn.at, now)

    def pool_recent_requests(self, now: float) -> float:
        """Requests recorded for all workers, halved every ``heat_half_life_s``."""
        churn = self._pool_churn
        return churn.requests * self._decay_factor(churn.at, now)

    def recent_blocks(self, worker_id: str, now: float) -> float:
        """Prompt blocks (cached or not) of the requests recorded for ``worker_id``, halved
        every ``heat_half_life_s``."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0.0
        return cache.churn.routed_blocks * self._decay_factor(cache.churn.at, now)

    def session_blocks(self, block: int, now: float) -> float:
        """Prompt blocks routed recently (halved every ``heat_half_life_s``) for the session
        that recorded the prefix ``block`` names: the chain of prompts extending each other."""
        node = self._nodes.get(block)
        churn = self._sessions.get(node.session) if node is not None else None
        return churn.routed_blocks * self._decay_factor(churn.at, now) if churn else 0.0

    def pool_recent_blocks(self, now: float) -> float:
        """Prompt blocks of the requests recorded for all workers, halved every
        ``heat_half_life_s``."""
        churn = self._pool_churn
        return churn.routed_blocks * self._decay_factor(churn.at, now)

    def mean_new_blocks(self) -> float:
        """Blocks a recorded request added to its worker's cache, on average over all workers
        (recent requests weigh more); 0 before the first record."""
        churn = self._pool_churn
        return churn.new_blocks / churn.requests if churn.requests > 0 else 0.0

    def tail_age(self, worker_id: str, now: float) -> float:
        """Seconds since the least recently used block of ``worker_id`` was last used, once its
        modelled cache is full (the next block recorded evicts it); ``inf`` while it has room."""
        cache = self._caches.get(worker_id)
        if cache is None or cache.held < self._capacity.get(worker_id, self._default_capacity):
            return math.inf
        oldest = self._oldest_leaf(cache, worker_id)
        return math.inf if oldest is None else max(0.0, now - oldest[1].at)


@value
class IndexView:
    """A :class:`PrefixIndex` read at one instant: the ``PrefixMatcher`` routing policies see."""

    index: PrefixIndex
    now: float

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        return self.index.match(blocks, self.now)

    def heat(self, block: int) -> float:
        return self.index.heat(block, self.now)

    def branched(self, block: int) -> bool:
        return self.index.branched(block)

    def branches_grow(self, block: int) -> bool:
        return self.index.branches_grow(block)

    def extends(self, block: int, depth: int) -> bool:
        return self.index.extends(block, depth)

    def recent_requests(self, worker_id: str) -> float:
        return self.index.recent_requests(worker_id, self.now)

    def pool_recent_requests(self) -> float:
        return self.index.pool_recent_requests(self.now)

    def recent_blocks(self, worker_id: str) -> float:
        return self.index.recent_blocks(worker_id, self.now)

    def pool_recent_blocks(self) -> float:
        return self.index.pool_recent_blocks(self.now)

    def session_blocks(self, block: int) -> float:
        return self.index.session_blocks(block, self.now)

    def mean_new_blocks(self) -> float:
        return self.index.mean_new_blocks()

    def tail_age(self, worker_id: str) -> float:
        return self.index.tail_age(worker_id, self.now)

    def fill(self, worker_id: str) -> float:
        return self.index.fill(worker_id)
