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

The tree is stored as *runs*: the chain of checkpoints one record added is one run (split in two
where a later prompt goes on from inside it), and since a worker holding a checkpoint holds the
ones before it, each worker's hold on a run is a leading part of it: the last use of each
checkpoint it holds, in two lists whose length is how far it holds. A checkpoint costs a dict
entry and a few list slots, not objects of its own, so adding and evicting the blocks of long
new prompts stays cheap.

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

The decayed counts (heat, churn, sessions, forks) live in :mod:`gateway.routing.recency`; this
module finds, for each record, which of them it feeds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from gateway.routing.recency import Churn, Fork, Recency


@dataclass(slots=True)
class _Hold:
    """One worker's hold on the leading checkpoints ``0 .. len(seqs) - 1`` of one run.
    ``seqs[i]``/``ats[i]``: the last use of checkpoint ``i`` (for the last one held, the newest
    use of anything below it too, once that is evicted); ``children``: the runs right below this
    one that the worker holds (only when it holds the whole run)."""

    seqs: list[int]
    ats: list[float]
    children: int = 0


@dataclass(slots=True, eq=False)
class _Run:
    """A chain of checkpoints, each the parent of the next; the first one's parent is the last
    checkpoint of ``parent`` (None: a prompt's first). The checkpoints one record added, all
    with that prompt's ``end`` (its length in blocks), ``fork`` (the fork it went on from: the
    deepest prefix known before it, or for a prompt that extended another, that prompt's fork;
    None for the first prompt on its path and the prompts extending it) and ``session`` (the
    chain of prompts extending each other). A run is split where another prompt goes on from
    inside it, so only a run's last checkpoint has children: the runs in ``children``."""

    id: int
    blocks: list[int]
    depths: list[int]
    parent: _Run | None
    holds: dict[str, _Hold]
    end: int
    fork: int | None
    session: int
    children: set[_Run] = field(default_factory=set)

    def is_leaf(self, hold: _Hold) -> bool:
        """Whether the last checkpoint ``hold`` holds has no held checkpoint below it."""
        return len(hold.seqs) < len(self.blocks) or hold.children == 0

    def base_depth(self) -> int:
        """Depth in blocks of the checkpoint before the run's first (0: none)."""
        return self.parent.depths[-1] if self.parent is not None else 0


@dataclass(slots=True)
class _Cache:
    """The modelled cache of one worker."""

    held: int = 0  # blocks
    runs: set[_Run] = field(default_factory=set)  # the runs it holds part of
    # Heap of (seq, run id, run): the last checkpoint the worker holds of that run, a leaf
    # last used at seq (entries go stale as holds change; checked when they come up).
    leaves: list[tuple[int, int, _Run]] = field(default_factory=list)
    churn: Churn = field(default_factory=Churn)


class PrefixIndex:
    def __init__(
        self, capacity: int = 1_000_000, ttl_s: float = 600.0, heat_half_life_s: float = 30.0
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._recency = Recency(heat_half_life_s)
        self._default_capacity = capacity
        self._ttl_s = ttl_s
        # Checkpoint hash -> its run and its place in it.
        self._where: dict[int, tuple[_Run, int]] = {}
        self._next_run = 0
        self._caches: dict[str, _Cache] = {}
        self._capacity: dict[str, int] = {}
        self._seq = 0
        self._swept_at = -math.inf

    def __len__(self) -> int:
        return len(self._where)

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
        at = self._where.get(block)
        if at is None:
            return False
        hold = at[0].holds.get(worker_id)
        return hold is not None and len(hold.seqs) > at[1]

    def _held_count(self, blocks: Sequence[int], worker_id: str, hi: int) -> int:
        """How many leading checkpoints of ``blocks[:hi]`` ``worker_id`` holds."""
        where = self._where
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            at = where.get(blocks[mid - 1])
            if (at is not None and (hold := at[0].holds.get(worker_id)) is not None
                    and len(hold.seqs) > at[1]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _known_count(self, blocks: Sequence[int], hi: int, skip: dict[str, int]) -> int:
        """How many leading checkpoints of ``blocks[:hi]`` some worker not in ``skip`` holds."""
        where = self._where
        lo = 0
        if not skip:  # every checkpoint has a holder (the last hold to go takes it along)
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if blocks[mid - 1] in where:
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            at = where.get(blocks[mid - 1])
            if at is not None and not at[0].holds.keys() <= skip.keys():
                pos = at[1]
                for wid, hold in at[0].holds.items():
                    if len(hold.seqs) > pos and wid not in skip:
                        lo = mid
                        break
                else:
                    hi = mid - 1
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
            run, pos = self._where[blocks[count - 1]]
            if pos:
                for wid, hold in run.holds.items():
                    if len(hold.seqs) > pos and wid not in found:
                        found[wid] = count
            else:  # a run's first checkpoint: every hold on it holds that
                for wid in run.holds:
                    if wid not in found:
                        found[wid] = count
            hi = count - 1
        return found

    def heat(self, block: int, now: float) -> float:
        """How many recorded requests shared the prefix ``block`` names (as their deepest known
        part, or as their end), halved every ``heat_half_life_s``: a system prompt many users
        send is hot, one conversation's history is not."""
        return self._recency.heat_of(block, now)

    def branched(self, block: int) -> bool:
        """Whether some worker holds a checkpoint right below the prefix ``block`` names: a
        recorded prompt went on past it. For the deepest prefix of a request that some worker
        holds, that continuation is another prompt's, so the prefix is a trunk the request
        branches from (a shared system or tool prompt), not the end of a prompt it extends."""
        at = self._where.get(block)
        if at is None:
            return False
        run, pos = at
        if pos + 1 < len(run.blocks):  # inside a run: its next checkpoint, if someone holds it
            return any(len(hold.seqs) > pos + 1 for hold in run.holds.values())
        return any(hold.children for hold in run.holds.values())

    def extends(self, block: int, depth: int) -> bool:
        """Whether a prompt that goes on past the prefix ``block`` names to its next checkpoint
        at ``depth`` blocks *extends* the prompt that recorded that prefix (goes on from its
        end, as a session's next turn does) rather than sharing it from inside (as another
        question on a shared document or system prompt does)."""
        at = self._where.get(block)
        return at is not None and depth > at[0].end

    def branches_grow(self, block: int, unseen: bool | None = None) -> bool:
        """Whether the prompts that went on from the fork ``block`` names grow: later prompts
        extended them (went on from the end of one, as a session's next turn does) at least
        as often as they reused them (went on from inside one, as requests sharing a document
        after a system prompt do). A fork with no such record yet is ``unseen``, or with None
        taken to be like the pool's forks so far (true before anything is seen)."""
        return self._recency.branches_grow(block, unseen)

    # -- writes -------------------------------------------------------------------------------

    def record(
        self, blocks: Sequence[int], worker_id: str, now: float, depths: Sequence[int] = ()
    ) -> None:
        """``worker_id`` holds the prefixes ``blocks`` name from ``now`` on; ``depths[i]`` is
        the depth in blocks of ``blocks[i]`` (empty: ``i + 1``, every block a checkpoint). A key
        whose blocks are not a path of the tree (ids that are not chained hashes) is recorded as
        far as they are one."""
        n = len(blocks)
        if n == 0:
            return
        self._expire(now)
        cache = self._caches.get(worker_id)
        if cache is None:
            cache = self._caches[worker_id] = _Cache(churn=Churn(at=now))
        where = self._where
        self._seq += 1
        seq = self._seq
        held = self._held_count(blocks, worker_id, n)
        shared = max(held, self._known_count(blocks, n, {}))
        total = depths[n - 1] if depths else n
        fork: int | None = None
        session = -1  # a prompt that extends the one that added ``known`` continues its session
        if shared:
            known = where[blocks[shared - 1]][0]
            self._recency.heat_up(blocks[shared - 1], now)
            if shared < n:
                after = depths[shared] if depths else shared + 1
                if after > known.end:
                    session = known.session
                fork = self._went_on(known, blocks[shared - 1], after, now)
            else:
                session = known.session
        if session < 0:
            session = self._recency.new_session()
        # The worker's hold on the run of the deepest checkpoint it holds, then on the runs the
        # known part goes through (each a leading part, one list slot per checkpoint).
        run: _Run | None = None
        hold: _Hold | None = None
        if held:
            run = where[blocks[held - 1]][0]
            hold = run.holds[worker_id]
        i = held
        while i < shared:
            at = where.get(blocks[i])
            if at is None:
                break
            nxt, pos = at
            below = nxt is not run  # on into a run below: at its first checkpoint
            if below:
                follows = not pos and nxt.parent is run and worker_id not in nxt.holds
            else:
                follows = hold is not None and pos == len(hold.seqs)
            stop = min(shared, i + len(nxt.blocks) - pos)
            if not follows or nxt.blocks[pos + stop - i - 1] != blocks[stop - 1]:
                break  # not the tree's next checkpoints
            if below:
                if hold is not None:
                    hold.children += 1
                hold = nxt.holds[worker_id] = _Hold([], [])
                cache.runs.add(nxt)
                run = nxt
            assert hold is not None
            hold.seqs.extend(repeat(seq, stop - i))
            hold.ats.extend(repeat(now, stop - i))
            i = stop
        if i < shared:  # ids that leave the tree: recorded as far as they follow it
            n = shared = i
            if n == 0:
                return
        if shared < n:
            # The checkpoints no worker holds yet: a run of their own below the deepest known
            # one (whose run is split there if it goes on).
            self._next_run += 1
            new = _Run(self._next_run, list(blocks[shared:n]),
                       list(depths[shared:n]) if depths else list(range(shared + 1, n + 1)),
                       None, {}, total, fork, session)
            for j, h in enumerate(new.blocks):
                entry = (new, j)
                if where.setdefault(h, entry) is not entry:  # known after all: not a path
                    del new.blocks[j:]
                    del new.depths[j:]
                    break
            m = len(new.blocks)
            n = shared + m
            if m:
                if run is not None and hold is not None:
                    last = where[blocks[shared - 1]][1]  # the deepest known checkpoint
                    if last + 1 < len(run.blocks):
                        self._split(run, last + 1)
                    hold.children += 1
                    run.children.add(new)
                    new.parent = run
                hold = new.holds[worker_id] = _Hold([seq] * m, [now] * m)
                cache.runs.add(new)
                run = new
        run, pos = where[blocks[n - 1]]  # the deepest checkpoint of the key, held now
        hold = run.holds[worker_id]
        if held == n:  # already held: this is a use of it
            hold.seqs[pos], hold.ats[pos] = seq, now
        if shared < n:
            self._recency.heat_up(blocks[n - 1], now)
        before = (depths[held - 1] if depths else held) if held else 0
        new_blocks = run.depths[pos] - before if n > held else 0
        cache.held += new_blocks
        if pos == len(hold.seqs) - 1 and run.is_leaf(hold):
            heapq.heappush(cache.leaves, (seq, run.id, run))
        self._trim(worker_id, self.capacity(worker_id))
        self._recency.recorded(cache.churn, session, new_blocks, total, now)

    def _split(self, run: _Run, at: int) -> None:
        """Split ``run`` before its checkpoint ``at``: the rest goes to a run of its own, with
        the holds on it, below what stays."""
        self._next_run += 1
        rest = _Run(self._next_run, run.blocks[at:], run.depths[at:], run, {}, run.end,
                    run.fork, run.session, run.children)
        for child in rest.children:
            child.parent = rest
        run.children = {rest}
        del run.blocks[at:]
        del run.depths[at:]
        where = self._where
        for j, h in enumerate(rest.blocks):
            where[h] = (rest, j)
        for wid, hold in run.holds.items():
            if len(hold.seqs) > at:
                moved = rest.holds[wid] = _Hold(hold.seqs[at:], hold.ats[at:], hold.children)
                del hold.seqs[at:]
                del hold.ats[at:]
                hold.children = 1
                cache = self._caches[wid]
                cache.runs.add(rest)
                if rest.is_leaf(moved):
                    heapq.heappush(cache.leaves, (moved.seqs[-1], rest.id, rest))

    def _went_on(self, known: _Run, block: int, after: int, now: float) -> int | None:
        """A prompt went on past ``block`` (its deepest known prefix, in the run ``known``) to
        its next checkpoint at depth ``after``; returns the fork of the prompt being recorded.

        It *extends* the prompt that added ``block`` when that checkpoint is past that one's
        end (``block`` is that end, or where checkpoints are sparse, the last one of both
        before it): it goes on from the same fork, and the fork is told. Otherwise
        ``block`` is its fork; when ``block`` was no fork before, the prompt that added
        it was *reused* from inside, and that prompt's fork is told. Going on from a
        known fork (a new session off a shared system prompt) is neither, and so is going on
        from the first prompt on a path (which went on from no fork): that finds a fork."""
        if after > known.end:
            if known.fork is not None:
                self._tally(known.fork, True, now)
            return known.fork
        forks = self._recency.forks
        if block not in forks:
            if known.fork is not None:
                self._tally(known.fork, False, now)
            forks[block] = Fork(at=now)
        return block

    def _tally(self, fork: int, extended: bool, now: float) -> None:
        """Tell a fork (and the pool's forks) what a later prompt did with what went on from
        it; a fork no longer known counts for the pool only."""
        forks = self._recency.forks
        stats = forks.get(fork)
        if stats is None and fork in self._where:
            stats = forks[fork] = Fork(at=now)
        self._recency.tally(stats, extended, now)

    def last_use(self, worker_id: str, block: int) -> int:
        """When ``worker_id`` last used the prefix ``block`` names, as a sequence number of
        the index's records (0: not held). Exact for the end of a recorded prompt (a leaf); for
        a prefix others went on past, the use that made it a leaf (earlier, never later)."""
        at = self._where.get(block)
        if at is None:
            return 0
        hold = at[0].holds.get(worker_id)
        return hold.seqs[at[1]] if hold is not None and len(hold.seqs) > at[1] else 0

    def evict_used_before(self, worker_id: str, seq: int, floor: int = 0) -> int:
        """``worker_id`` evicted a prefix it last used at ``seq``: an LRU cache evicts what it
        used less recently first, so drop those, least recently used first, as far as
        ``floor`` blocks left. Returns the blocks it is modelled to hold then."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0
        while cache.held > floor:
            oldest = self._oldest_leaf(cache, worker_id)
            if oldest is None or oldest[1].seqs[-1] > seq:
                break
            self._evict(worker_id, oldest[0])
        return cache.held

    def forget(self, worker_id: str, blocks: Sequence[int], keep: int = 0) -> None:
        """``worker_id`` does not hold ``blocks[keep:]`` (a prediction that did not happen):
        its holds on them go, deepest first, as far as nothing below them is held."""
        where = self._where
        for h in reversed(blocks[keep:]):
            at = where.get(h)
            hold = at[0].holds.get(worker_id) if at is not None else None
            if at is None or hold is None or len(hold.seqs) <= at[1]:
                continue
            if len(hold.seqs) > at[1] + 1 or not at[0].is_leaf(hold):
                break  # something below it is held
            self._evict(worker_id, at[0])

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
        doomed = [(-run.depths[i], seq, h) for run in cache.runs
                  for i, (h, seq) in enumerate(zip(run.blocks, run.holds[worker_id].seqs,
                                                   strict=False))
                  if not keep(h)]
        # Leaves before their parents, and of a parent's children the most recently used
        # last, so that the parent, a leaf then, is as recent as the newest use below it.
        doomed.sort()
        where = self._where
        for _, _, h in doomed:
            at = where.get(h)
            hold = at[0].holds.get(worker_id) if at is not None else None
            if at is not None and hold is not None and len(hold.seqs) == at[1] + 1:
                self._evict(worker_id, at[0])

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that left or restarted (its cache is gone with it)."""
        cache = self._caches.pop(worker_id, None)
        if cache is None:
            return
        for run in cache.runs:
            run.holds.pop(worker_id, None)
            keep = max((len(hold.seqs) for hold in run.holds.values()), default=0)
            if keep < len(run.blocks):  # what no one else holds goes, with the runs below it
                for h in run.blocks[keep:]:
                    self._drop(h)
                del run.blocks[keep:]
                del run.depths[keep:]
                run.children.clear()
            if not run.holds and run.parent is not None:
                run.parent.children.discard(run)

    # -- eviction -----------------------------------------------------------------------------

    def _drop(self, block: int) -> None:
        """Forget a checkpoint no worker holds."""
        del self._where[block]
        self._recency.drop(block)

    def _let_go(self, cache: _Cache, worker_id: str, run: _Run) -> tuple[_Run, _Hold] | None:
        """``worker_id`` holds nothing of ``run`` any more: its hold goes (and the run from
        its parent's children once no one holds it). The parent run and the worker's hold on
        it when that hold's last checkpoint is a leaf now, else None."""
        del run.holds[worker_id]
        cache.runs.discard(run)
        parent = run.parent
        if parent is None:
            return None
        if not run.holds:
            parent.children.discard(run)
        up = parent.holds.get(worker_id)
        if up is None:
            return None
        up.children -= 1
        return None if up.children else (parent, up)

    def _oldest_leaf(self, cache: _Cache, worker_id: str) -> tuple[_Run, _Hold] | None:
        """The least recently used leaf of a worker, as the run and the worker's hold whose last
        checkpoint it is (stale heap entries are dropped)."""
        leaves = cache.leaves
        while leaves:
            seq, _, run = leaves[0]
            hold = run.holds.get(worker_id)
            if hold is not None and hold.seqs and hold.seqs[-1] == seq and run.is_leaf(hold):
                return run, hold
            heapq.heappop(leaves)
        return None

    def _evict(self, worker_id: str, run: _Run) -> None:
        """Drop the last checkpoint ``worker_id`` holds of ``run`` (a leaf); the one before it
        becomes a leaf, as recent as the newest use below it. (:meth:`_trim` evicts the same
        way, inline.)"""
        cache = self._caches[worker_id]
        hold = run.holds[worker_id]
        pos = len(hold.seqs) - 1
        seq, at = hold.seqs.pop(), hold.ats.pop()
        cache.held -= run.depths[pos] - (run.depths[pos - 1] if pos else run.base_depth())
        if pos + 1 == len(run.blocks) and all(len(o.seqs) <= pos for o in run.holds.values()):
            self._drop(run.blocks.pop())
            run.depths.pop()
        up_run, up = run, hold
        if not pos:  # the run's first: the hold goes, and the parent run's may become a leaf
            above = self._let_go(cache, worker_id, run)
            if above is None:
                return
            up_run, up = above
        if seq > up.seqs[-1]:
            up.seqs[-1] = seq
        if at > up.ats[-1]:
            up.ats[-1] = at
        heapq.heappush(cache.leaves, (up.seqs[-1], up_run.id, up_run))

    def _trim(self, worker_id: str, limit: int) -> None:
        """Evict ``worker_id``'s least recently used leaves until it holds ``limit`` blocks.

        :meth:`_evict`, chained: a checkpoint that becomes a leaf no more recent than the leaf
        just evicted is the least recently used leaf now (no two leaves share a use), so it is
        evicted next without a round through the heap. A prompt's tail goes that way, as many
        checkpoints of one hold at a time as are no more recent than its last one (the blocks
        one prompt added) and as the limit asks for: a slice off the hold's lists."""
        cache = self._caches.get(worker_id)
        if cache is None or cache.held <= limit:
            return
        leaves = cache.leaves
        where, forks, heat = self._where, self._recency.forks, self._recency.heat
        held = cache.held
        following: _Run | None = None  # the run whose hold's last checkpoint goes next
        while held > limit:
            if following is None:
                oldest = self._oldest_leaf(cache, worker_id)
                if oldest is None:
                    break
                run, hold = oldest
            else:
                run, following = following, None
                hold = run.holds[worker_id]
            seqs, ats, depths = hold.seqs, hold.ats, run.depths
            last = len(seqs) - 1
            seq = seqs[last]
            # Checkpoints start..last go: those before the last as long as each is no more
            # recent than it and the blocks after it are still over the limit.
            floor = depths[last] - (held - limit)
            start = last
            while start and seqs[start - 1] <= seq and depths[start - 1] > floor:
                start -= 1
            at = max(ats[start:])
            held -= depths[last] - (depths[start - 1] if start else run.base_depth())
            del seqs[start:]
            del ats[start:]
            if last + 1 == len(depths):  # the run's end went: so does what no one else holds
                kept = start
                for other in run.holds.values():
                    if len(other.seqs) > kept:
                        kept = len(other.seqs)
                        if kept > last:  # someone holds it all (a shared prompt's run)
                            break
                if kept <= last:
                    for h in run.blocks[kept:]:  # self._drop(h), inline: once per block
                        del where[h]
                        forks.pop(h, None)
                        heat.pop(h, None)
                    del run.blocks[kept:]
                    del depths[kept:]
            if not start:  # the whole hold: it goes, and the parent run's may become a leaf
                above = self._let_go(cache, worker_id, run)
                if above is None:
                    continue
                run, seqs, ats = above[0], above[1].seqs, above[1].ats
            # A leaf now, as recent as the newest use below it.
            if at > ats[-1]:
                ats[-1] = at
            if seqs[-1] <= seq:
                seqs[-1] = seq
                following = run  # the least recently used leaf now: evicted next
            else:
                heapq.heappush(leaves, (seqs[-1], run.id, run))
        cache.held = held
        if following is not None:  # not evicted after all: a leaf like any other
            heapq.heappush(leaves, (following.holds[worker_id].seqs[-1], following.id, following))

    def _expire(self, now: float) -> None:
        """Drop entries unused for ``ttl_s`` (checked every ``ttl_s / 64`` at most)."""
        if now - self._swept_at < self._ttl_s / 64:
            return
        self._swept_at = now
        cutoff = now - self._ttl_s
        self._recency.expire_sessions(cutoff)
        for wid, cache in self._caches.items():
            while ((oldest := self._oldest_leaf(cache, wid)) is not None
                   and oldest[1].ats[-1] < cutoff):
                self._evict(wid, oldest[0])

    # -- recent traffic (gateway.routing.recency) ----------------------------------------------

    def recent_requests(self, worker_id: str, now: float) -> float:
        """Requests recorded for ``worker_id``, halved every ``heat_half_life_s``."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0.0
        return cache.churn.requests * self._recency.factor(cache.churn.at, now)

    def pool_recent_requests(self, now: float) -> float:
        """Requests recorded for all workers, halved every ``heat_half_life_s``."""
        churn = self._recency.pool
        return churn.requests * self._recency.factor(churn.at, now)

    def recent_blocks(self, worker_id: str, now: float) -> float:
        """Prompt blocks (cached or not) of the requests recorded for ``worker_id``, halved
        every ``heat_half_life_s``."""
        cache = self._caches.get(worker_id)
        if cache is None:
            return 0.0
        return cache.churn.routed_blocks * self._recency.factor(cache.churn.at, now)

    def session_blocks(self, block: int, now: float) -> float:
        """Prompt blocks routed recently (halved every ``heat_half_life_s``) for the session
        that recorded the prefix ``block`` names: the chain of prompts extending each other."""
        at = self._where.get(block)
        return self._recency.session_blocks(at[0].session, now) if at is not None else 0.0

    def pool_recent_blocks(self, now: float) -> float:
        """Prompt blocks of the requests recorded for all workers, halved every
        ``heat_half_life_s``."""
        churn = self._recency.pool
        return churn.routed_blocks * self._recency.factor(churn.at, now)

    def mean_new_blocks(self) -> float:
        """Blocks a recorded request added to its worker's cache, on average over all workers
        (recent requests weigh more); 0 before the first record."""
        churn = self._recency.pool
        return churn.new_blocks / churn.requests if churn.requests > 0 else 0.0

    def tail_age(self, worker_id: str, now: float) -> float:
        """Seconds since the least recently used block of ``worker_id`` was last used, once its
        modelled cache is full (the next block recorded evicts it); ``inf`` while it has room."""
        cache = self._caches.get(worker_id)
        if cache is None or cache.held < self._capacity.get(worker_id, self._default_capacity):
            return math.inf
        oldest = self._oldest_leaf(cache, worker_id)
        return math.inf if oldest is None else max(0.0, now - oldest[1].ats[-1])


class IndexView:
    """A :class:`PrefixIndex` read at one instant: the ``PrefixMatcher`` routing policies see.
    The reads that do not depend on the instant are the index's own methods (one call each:
    a policy asks some of them once per candidate)."""

    __slots__ = (
        "branched",
        "branches_grow",
        "extends",
        "fill",
        "index",
        "mean_new_blocks",
        "now",
    )

    def __init__(self, index: PrefixIndex, now: float) -> None:
        self.index = index
        self.now = now
        self.branched: Callable[[int], bool] = index.branched
        self.branches_grow: Callable[[int], bool] = index.branches_grow
        self.extends: Callable[[int, int], bool] = index.extends
        self.mean_new_blocks: Callable[[], float] = index.mean_new_blocks
        self.fill: Callable[[str], float] = index.fill

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        return self.index.match(blocks, self.now)

    def heat(self, block: int) -> float:
        return self.index.heat(block, self.now)

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

    def tail_age(self, worker_id: str) -> float:
        return self.index.tail_age(worker_id, self.now)
