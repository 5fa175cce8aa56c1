"""The hybrid view of an event-fed worker: the modelled cache, corrected by the engine's events.

The modelled index (:mod:`gateway.routing.prefix_index`) changes when this gateway decides, so
it never lags behind its own decisions. An engine's KV events arrive a moment after the engine
acted (the publisher batches them, the gateway's loop reads them), and under load that moment
spans many decisions: a view built from the events alone misses what the requests already on
their way will store and evict. The hybrid keeps the model's view and lets the events correct
only what the model cannot know:

* **Removed**: a block the engine reports removed leaves the model's view of that worker
  (:attr:`Corrections.gone`), unless this gateway sent it there again since. While a request
  of this gateway that carries the block is in flight there, the removal is stale: an engine
  never evicts a block a running request holds, so it happened before that request was
  admitted, and admitting it stores the block again. A removal published before such a
  request *ended* is in doubt: it counts once the worker's later batches (published after the
  request's end) show no store of the block followed it, or ``settle_s`` after it arrived.
  The next send of the block (the model records it anew) or a store event brings it back.
* **Stored by someone else**: a block the engine reports stored, that the model does not hold,
  that no request of this gateway in flight carries and that was published after the last
  such request ended, was put there by another gateway, a client that bypassed the gateway,
  or before this gateway started (the bootstrap replay). It counts as held
  (:attr:`Corrections.foreign`) until the engine removes it or this gateway sends it (from
  then on the model keeps it, evictions included).
* **Reset**: AllBlocksCleared, a restart, or a gap the publisher cannot replay empties the
  worker's view: the model forgets the worker (``on_reset``), but for the prompts of requests
  in flight or ended after the reset was published (admitting them stored their blocks
  again), and the corrections start over from the events that follow.

Costs: per event, O(blocks in it), times the requests of this gateway in flight there or just
ended for a block one of them may carry; per decision, the model's match, plus, where a worker
the model (or a foreign store of the prompt's first block) says holds the prompt has removed or
foreign blocks, one set of the prompt's blocks (built in C, once) and a walk over its leading
blocks only when one of them is in the prompt; per send, one set of the prompt's blocks (a
request is remembered whole, not block by block); per answer, O(1). Pure: no I/O, time is an
argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.routing.types import PrefixMatcher


@dataclass(slots=True)
class CorrectionStats:
    removed: int = 0  # removals that took a block out of the model's view
    kept: int = 0  # removals of a block a request in flight carries (admitting it stores it)
    foreign: int = 0  # blocks stored by someone else, counted as held
    resets: int = 0


# Whether the modelled index holds a block for a worker (None: not known).
ModelHolds = Callable[[str, int], bool | None]


@dataclass(slots=True)
class WallClock:
    """Turns the gateway's decision clock (monotonic) into wall-clock seconds, the clock of
    the engines' event batches (``EventBatch.ts``)."""

    offset: float = 0.0  # wall - monotonic

    def wall(self, now: float) -> float:
        return now + self.offset


@dataclass(slots=True)
class _Carried:
    """The blocks of one prompt this gateway sent and has not seen end (``count``: requests
    in flight with this very key sequence)."""

    keys: Sequence[int]
    blocks: frozenset[int]
    count: int = 1


def _common(d: Mapping[int, object], blocks: frozenset[int]) -> list[int]:
    """The keys of ``d`` in ``blocks``, walking the smaller of the two."""
    if len(d) <= len(blocks):
        return [k for k in d if k in blocks]
    return [k for k in blocks if k in d]


def _meets(d: Mapping[int, object], blocks: frozenset[int]) -> bool:
    """Whether a key of ``d`` is in ``blocks``, walking the smaller of the two."""
    if len(d) <= len(blocks):
        return any(k in blocks for k in d)
    return any(k in d for k in blocks)


@dataclass(slots=True)
class Corrections:
    """What one worker's events changed in the model's view of its cache.

    Ordering: an event batch is stamped with the engine's clock when it was published. A
    request's send and its end are stamped with this gateway's. An event published before the
    request ended (plus ``skew_s`` for the two clocks and the publisher's flush) may predate
    the engine admitting it; one published later cannot."""

    worker_id: str
    holders: dict[int, set[str]]  # foreign block -> workers holding it (shared by the fleet)
    model_holds: ModelHolds | None = None  # None: unknown (every removal is recorded)
    # The model keeps of the worker only the blocks the predicate accepts.
    on_reset: Callable[[str, Callable[[int], bool]], None] | None = None
    clock: WallClock = field(default_factory=WallClock)
    skew_s: float = 0.005
    settle_s: float = 2.0  # a removal in doubt counts after this long with no store
    max_blocks: int = 1 << 20
    max_ended: int = 4096  # ended requests whose events may still arrive, at most
    # The model's blocks the engine removed since the model last recorded them, oldest first.
    gone: dict[int, None] = field(default_factory=dict)
    # Blocks the engine holds that someone else stored (the model does not hold them).
    foreign: dict[int, None] = field(default_factory=dict)
    stats: CorrectionStats = field(default_factory=CorrectionStats)
    # The prompts of this gateway's requests in flight here, by the id of their key sequence.
    _carried: dict[int, _Carried] = field(default_factory=dict)
    # Requests that ended: (fence, blocks), in the order they ended; events published up to
    # the fence (the end, plus skew_s) may still be their doing.
    _ended: deque[tuple[float, frozenset[int]]] = field(default_factory=deque)
    # Every block of the requests above, and perhaps of some that left them since (rebuilt
    # when it holds twice what they do): most blocks an engine evicts are in none of them,
    # and this answers that in one lookup.
    _maybe: set[int] = field(default_factory=set)
    _live: int = 0  # blocks of the requests above, counted once per entry
    # Removals that may predate the admission of a request that carried the block:
    # block -> (fence, arrival), in arrival order.
    _doubt: dict[int, tuple[float, float]] = field(default_factory=dict)
    _stream: float = 0.0  # publication time of the batch being applied (wall)

    def _models(self, key: int) -> bool | None:
        holds = self.model_holds
        return None if holds is None else holds(self.worker_id, key)

    def _in_flight(self, key: int) -> bool:
        """Whether a request of this gateway in flight here carries ``key``."""
        return key in self._maybe and any(key in c.blocks for c in self._carried.values())

    def _ours(self, key: int) -> float | None:
        """The fence of ``key`` when the event being applied may be this gateway's doing: that
        of the last request that carried it and ended no earlier than the event."""
        if key not in self._maybe:
            return None
        stream = self._stream
        for fence, blocks in reversed(self._ended):
            if fence >= stream and key in blocks:
                return fence
        return None

    # -- the engine's events --------------------------------------------------------------------
    def begin(self, ts: float, now: float) -> None:
        """A batch published at ``ts`` (wall; 0: unknown, taken as its arrival at ``now``)."""
        self._stream = ts if ts > 0 else self.clock.wall(now)

    def end(self) -> None:
        """Every event published up to the current batch is applied: removals in doubt whose
        fence it passed are removals (no store followed them), and fences it passed go."""
        stream, doubt = self._stream, self._doubt
        while doubt:
            key = next(iter(doubt))
            if doubt[key][0] >= stream:
                break
            del doubt[key]
            self._gone(key)
        ended = self._ended
        while ended and ended[0][0] < stream:
            self._live -= len(ended.popleft()[1])

    def stored(self, key: int, now: float) -> None:
        self.gone.pop(key, None)
        self._doubt.pop(key, None)
        if key in self.foreign or self._in_flight(key) or self._ours(key) is not None:
            return
        if self._models(key):
            return
        self.foreign[key] = None
        self.holders.setdefault(key, set()).add(self.worker_id)
        self.stats.foreign += 1

    def removed(self, key: int, now: float) -> None:
        self._unforeign(key)
        if self._in_flight(key):
            self.stats.kept += 1
            return
        if self._models(key) is False:
            return
        fence = self._ours(key)
        if fence is not None:
            # Published before a request that carried the block ended: perhaps before the
            # engine admitted it, and then the store its admission made is still to come.
            doubt = self._doubt
            doubt.pop(key, None)
            doubt[key] = (fence, now)
            return
        self._gone(key)

    def _gone(self, key: int) -> None:
        if self._in_flight(key):
            return
        gone = self.gone
        gone.pop(key, None)
        gone[key] = None
        self.stats.removed += 1
        if len(gone) > self.max_blocks:
            del gone[next(iter(gone))]

    def settle(self, now: float) -> None:
        """Removals in doubt for ``settle_s`` with no store since are removals (the feed may
        have gone quiet before its stream passed their fences)."""
        doubt, cutoff = self._doubt, now - self.settle_s
        while doubt:
            key = next(iter(doubt))
            if doubt[key][1] > cutoff:
                break
            del doubt[key]
            self._gone(key)

    def cleared(self) -> None:
        """The engine's cache was emptied when the current batch was published (or the feed
        lost track of it): the model keeps only what requests of this gateway in flight, or
        ended after that, carried (admitting them stored it again)."""
        for key in self.foreign:
            self._unhold(key)
        self.foreign.clear()
        self.gone.clear()
        self._doubt.clear()
        self.stats.resets += 1
        # Before its first batch the feed has said nothing the model's view could rest on.
        if self.on_reset is not None and self._stream > 0:
            self.on_reset(self.worker_id,
                          lambda k: self._in_flight(k) or self._ours(k) is not None)

    def dropped(self) -> None:
        """The worker left: its foreign blocks leave the fleet's map."""
        for key in self.foreign:
            self._unhold(key)
        self.foreign.clear()

    def _unforeign(self, key: int) -> None:
        if self.foreign.pop(key, 0) is None:
            self._unhold(key)

    def _unhold(self, key: int) -> None:
        workers = self.holders.get(key)
        if workers is not None:
            workers.discard(self.worker_id)
            if not workers:
                del self.holders[key]

    # -- this gateway's decisions ---------------------------------------------------------------
    def sent(self, keys: Sequence[int], now: float) -> None:
        """A prompt with ``keys`` went to the worker (the model recorded it)."""
        carried = self._carried.get(id(keys))
        if carried is not None and carried.keys is keys:
            carried.count += 1
            blocks = carried.blocks
        else:
            blocks = frozenset(keys)
            self._carried[id(keys)] = _Carried(keys, blocks)
            self._live += len(blocks)
            self._remember(blocks)
        # Usually all three are empty; otherwise only the blocks in both are touched.
        gone, doubt, foreign = self.gone, self._doubt, self.foreign
        for k in _common(gone, blocks) if gone else ():
            del gone[k]
        for k in _common(doubt, blocks) if doubt else ():
            del doubt[k]
        for k in _common(foreign, blocks) if foreign else ():
            self._unforeign(k)

    def _remember(self, blocks: frozenset[int]) -> None:
        """Add ``blocks`` to the set of all blocks of the requests in flight or just ended;
        rebuilt from those requests instead once it holds twice what they do."""
        maybe = self._maybe
        if len(maybe) <= 2 * self._live + 1024:
            maybe |= blocks
            return
        maybe.clear()
        for c in self._carried.values():
            maybe |= c.blocks
        for _, ended_blocks in self._ended:
            maybe |= ended_blocks

    def done(self, keys: Sequence[int], now: float) -> None:
        """The request that carried ``keys`` ended at ``now`` (answered, failed, abandoned)."""
        carried = self._carried.get(id(keys))
        if carried is None or carried.keys is not keys:
            # The same blocks as another sequence object (not how the gateway calls it).
            carried = next((c for c in self._carried.values() if c.keys == keys), None)
            if carried is None:
                return
        carried.count -= 1
        if carried.count <= 0:
            del self._carried[id(carried.keys)]
            self._live -= len(carried.blocks)
        ended = self._ended
        ended.append((self.clock.wall(now) + self.skew_s, carried.blocks))
        self._live += len(carried.blocks)
        if len(ended) > self.max_ended:
            self._live -= len(ended.popleft()[1])

    @property
    def inflight_requests(self) -> int:
        return sum(c.count for c in self._carried.values())

    # -- the view -------------------------------------------------------------------------------
    def depth(self, blocks: Sequence[int], modelled: int, now: float,
              blockset: Callable[[], frozenset[int]] | None = None) -> int:
        """Leading ``blocks`` the worker holds at ``now``: the model's ``modelled`` of them
        less those the engine removed since, plus what others stored there. ``blockset``:
        the set of ``blocks`` (built once per decision for every worker asked), which spares
        the walk over the prompt when no removed or foreign block is in it."""
        if self._doubt:
            self.settle(now)
        gone, foreign = self.gone, self.foreign
        if not gone and not foreign:
            return modelled
        if blockset is not None and modelled <= len(blocks):
            inside = blockset()
            if not _meets(gone, inside) and not _meets(foreign, inside):
                return modelled
        n = 0
        for i, k in enumerate(blocks):
            if k in foreign or (i < modelled and k not in gone):
                n += 1
            else:
                break
        return n


class CorrectedWorkers(Protocol):
    """The fleet's corrections (the exact index): which workers' events are live."""

    def is_live(self, worker_id: str) -> bool: ...

    def corrections(self, worker_id: str) -> Corrections | None: ...

    def foreign_holders(self, key: int) -> Collection[str]: ...

    def refresh(self, worker_id: str) -> None:
        """Apply the worker's events published up to now."""
        ...


class ModelledSignals:
    """What a view of the caches corrected by events takes unchanged from the modelled index
    ``base``, which records every decision: heat, branching, recent requests and churn."""

    __slots__ = ()
    base: PrefixMatcher  # a field of each subclass

    def heat(self, block: int) -> float:
        return self.base.heat(block)

    def branched(self, block: int) -> bool:
        return self.base.branched(block)

    def branches_grow(self, block: int) -> bool:
        return self.base.branches_grow(block)

    def extends(self, block: int, depth: int) -> bool:
        return self.base.extends(block, depth)

    def recent_requests(self, worker_id: str) -> float:
        return self.base.recent_requests(worker_id)

    def pool_recent_requests(self) -> float:
        return self.base.pool_recent_requests()

    def recent_blocks(self, worker_id: str) -> float:
        return self.base.recent_blocks(worker_id)

    def pool_recent_blocks(self) -> float:
        return self.base.pool_recent_blocks()

    def session_blocks(self, block: int) -> float:
        return self.base.session_blocks(block)

    def mean_new_blocks(self) -> float:
        return self.base.mean_new_blocks()

    def tail_age(self, worker_id: str) -> float:
        return self.base.tail_age(worker_id)

    def fill(self, worker_id: str) -> float:
        return self.base.fill(worker_id)


@dataclass(frozen=True, slots=True)
class HybridMatcher(ModelledSignals):
    """A :class:`PrefixMatcher`: the modelled index ``base``, with the depths of workers whose
    events are live corrected by them (:class:`Corrections`). Heat and churn come from
    ``base``.

    As in :class:`~gateway.kvevents.index.ExactMatcher`, a prefix that no worker holds at least
    ``floor`` blocks of once corrected is matched by the model alone: its modelled holders are
    where it lived until it was evicted, and its siblings go back there. :meth:`held` answers
    the corrected question (what the prediction of cached tokens uses).
    """

    base: PrefixMatcher
    workers: CorrectedWorkers
    now: float
    floor: int = 1
    # The last request's blocks and their set, built at most once for all the workers asked.
    _memo: list[tuple[Sequence[int], frozenset[int]]] = field(default_factory=list)

    def _blockset(self, blocks: Sequence[int]) -> Callable[[], frozenset[int]]:
        def build() -> frozenset[int]:
            memo = self._memo
            if memo and memo[0][0] is blocks:
                return memo[0][1]
            found = frozenset(blocks)
            memo[:] = [(blocks, found)]
            return found
        return build

    def _corrected(self, blocks: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        modelled = self.base.match(blocks)
        if not blocks:
            return modelled, modelled
        fleet = self.workers
        out = dict(modelled)
        candidates = list(modelled)
        candidates += [w for w in fleet.foreign_holders(blocks[0]) if w not in modelled]
        for wid in candidates:
            fleet.refresh(wid)
            fix = fleet.corrections(wid) if fleet.is_live(wid) else None
            if fix is None:
                continue
            depth = fix.depth(blocks, modelled.get(wid, 0), self.now, self._blockset(blocks))
            if depth:
                out[wid] = depth
            else:
                out.pop(wid, None)
        return modelled, out

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        modelled, out = self._corrected(blocks)
        if out is modelled or any(d >= self.floor for d in out.values()):
            return out
        return modelled

    def held(self, worker_id: str, blocks: Sequence[int]) -> int:
        """Leading ``blocks`` ``worker_id`` holds: the model's word, corrected by its events
        while they are live."""
        fleet = self.workers
        fleet.refresh(worker_id)
        modelled = self.base.match(blocks).get(worker_id, 0)
        fix = fleet.corrections(worker_id) if fleet.is_live(worker_id) else None
        return modelled if fix is None else fix.depth(blocks, modelled, self.now,
                                                      self._blockset(blocks))

