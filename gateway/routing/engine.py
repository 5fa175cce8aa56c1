"""The routing engine: filters -> weighted scorers -> picker, over one snapshot.

A *profile* names a policy and lists its plugins. Filters drop workers that must not get the
request (unhealthy, wrong model, over the load bound); scorers give each remaining worker a score
in [0, 1]; the picker chooses among the best total. The engine records why, as a typed
:class:`~gateway.routing.types.Decision` (kind, depth, the holder it passed over and why).

Pure and synchronous: no awaits, no network, no clocks. The cluster simulator runs this very code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Protocol

from gateway.routing.types import (
    Decision,
    DecisionKind,
    NoCandidates,
    PrefixMatcher,
    RouteRequest,
    Snapshot,
    WorkerView,
)
from gateway.values import value

# The volume guard (:meth:`RoutingEngine._volume`): its hysteresis, in multiples of the
# request's blocks; the share of a worker's fair volume a session must have routed recently
# to be moved; and the smaller share with which it is moved when another holder of part of
# its prompt has room for it. With copies: the part of what the holder holds that another
# holder must hold to count as the session's copy (a copy at a background priority is
# recorded once it answered, by when the holder has the session's next turn too; the move
# redoes at most the rest).
VOLUME_SLACK = 2.0
VOLUME_SESSION_SHARE = 0.5
VOLUME_MEDIUM_SHARE = 0.2
VOLUME_COPY_SHARE = 0.75
# A copy is made only while at most this share of the pool's workers has prefill queued
# (requests waiting for admission, a copy under way): capacity nobody else needs.
COPY_BUSY_SHARE = 0.25


@value
class Context:
    """One decision's inputs, with the prefix-index lookup done once for all plugins."""

    request: RouteRequest
    snapshot: Snapshot
    matches: Mapping[str, int]
    # Filters that enforce a load bound write each candidate's bound here (tokens, before the
    # request is added), so the decision can report how close the chosen worker was to it.
    load_bounds: dict[str, float] = field(default_factory=dict)
    # When the engine narrowed the candidates (``Profile.candidate_limit``): in-flight tokens
    # and weight of every healthy candidate it started from, so load bounds stay pool-wide.
    pool_load: tuple[int, float] | None = None
    # The deepest known prefix of this request is hot (many recent requests share it).
    hot: bool = False
    # Set when the request branches off a shared trunk with most of its prompt: the ring
    # anchor of the part past the trunk, from which it is placed as a cold prefix.
    branch_anchor: int | None = None

    @property
    def anchor(self) -> int:
        """Where the request's ring walk starts: past the trunk for a branch."""
        return self.request.key.anchor if self.branch_anchor is None else self.branch_anchor


class Filter(Protocol):
    name: str

    def apply(self, ctx: Context, candidates: Sequence[WorkerView]) -> list[WorkerView]: ...


class Scorer(Protocol):
    name: str

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        """Worker id -> score in [0, 1] for every candidate."""
        ...


class Picker(Protocol):
    name: str

    def pick(
        self, ctx: Context, candidates: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> tuple[WorkerView, str]:
        """The chosen worker and a short note on how it was chosen."""
        ...


@value
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    uses_prefix_index: bool = False
    # Shorter matches count as no match (a common first block says nothing about the rest).
    min_match_blocks: int = 1
    # 0: every worker is a candidate. k > 0: only the index's holders of this prefix and the
    # first k healthy workers on the ring from its anchor, so the cost of a decision does not
    # grow with the fleet (the load bound still uses pool-wide totals).
    candidate_limit: int = 0
    # A known prefix shared by at least this many recent requests (decayed) is hot; 0 = never.
    hot_threshold: float = 0.0
    # For a request whose deepest known prefix is a trunk other prompts went on from (a
    # shared system or tool prompt) and less than half of it, a holder of the trunk with more
    # than ``branch_guard`` times its share of the pool's recent requests gets no credit for
    # the trunk; with none left the request is placed as a cold prefix from the ring anchor
    # past the trunk (:meth:`RoutingEngine._branch`). Only for a trunk whose branches grow
    # (``PrefixMatcher.branches_grow``). 0: never.
    branch_guard: float = 0.0
    # A holder whose recent routed prompt blocks are over ``volume_guard`` times its share by
    # more than ``VOLUME_SLACK`` times the request's blocks gets no credit for what it holds,
    # for a session's next turn when the session is heavy (:meth:`RoutingEngine._volume`).
    # 0: never.
    volume_guard: float = 0.0
    # With the volume guard: a session over it moves only to a worker that already holds as
    # much of its prompt (a copy); until one does, its holder keeps it and the decision names
    # the worker to copy the prompt to (``Decision.copy_to``), so a move is never a prefill
    # on a request's path. False: the session moves at once and the request redoes it.
    volume_copy: bool = False
    # With copies: a copy recorded when it was sent that lacks turns its holder has had since
    # is brought up to date (copied again, only the difference computed there) before the
    # session moves to it, unless it cannot take the copy now; a whole copy with room takes
    # the session from a holder over its bound within the slack. False: the session moves to
    # a copy of three quarters of its holder's part, redoing the rest on a request's path.
    volume_refresh: bool = False


def _pool_weight(snapshot: Snapshot) -> float:
    """The ring weight of the whole pool (1 for an empty one)."""
    return (snapshot.pool_load[1] if snapshot.pool_load is not None
            else sum(w.worker.weight for w in snapshot.workers)) or 1.0


def _volume_share(snapshot: Snapshot, size: int) -> float:
    """A worker's fair share, per unit of weight, of the pool's recent routed blocks with a
    request of ``size`` blocks added (the volume guard's measure)."""
    return (snapshot.index.pool_recent_blocks() + size) / _pool_weight(snapshot)


def _has_room(index: PrefixMatcher, wid: str, weight: float, size: int, share: float,
              guard: float) -> bool:
    """Whether ``wid`` can take ``size`` more blocks within ``guard`` times its share."""
    return index.recent_blocks(wid) + size <= guard * share * weight


def _by_volume(ctx: Context) -> Callable[[WorkerView], tuple[float, int]]:
    """The sort key of the volume guard's destinations: least recent routed volume per unit
    of weight, equals in ring order from the request's anchor, as the picker's are (gateway
    replicas and the simulator choose alike whatever order their pools list workers in)."""
    index = ctx.snapshot.index
    order = {wid: i for i, wid in enumerate(ctx.snapshot.ring.walk(ctx.anchor))}

    def key(view: WorkerView) -> tuple[float, int]:
        return (index.recent_blocks(view.id) / (view.worker.weight or 1.0),
                order.get(view.id, len(order)))

    return key


def _copies_yield(snapshot: Snapshot, wid: str) -> bool:
    """Whether ``wid``'s engine runs copies at background priority (recorded once answered)."""
    if snapshot.by_id is not None:
        view = snapshot.by_id.get(wid)
        return view is not None and view.copies_yield
    return any(w.id == wid and w.copies_yield for w in snapshot.workers)


def _weight(by_id: Mapping[str, WorkerView] | None, wid: str) -> float:
    view = by_id.get(wid) if by_id is not None else None
    return view.worker.weight if view is not None else 1.0


class RoutingEngine:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.name = profile.name
        # Whether each decision must be recorded in the prefix index.
        self.uses_prefix_index = profile.uses_prefix_index

    def route(
        self, request: RouteRequest, snapshot: Snapshot, exclude: frozenset[str] = frozenset()
    ) -> Decision:
        """Choose a worker for ``request``; ``exclude`` holds workers that already failed it."""
        profile = self.profile
        matches, deepest, known = self._matches(request, snapshot)
        hot = bool(matches) and profile.hot_threshold > 0 and (
            snapshot.index.heat(request.key.blocks[deepest - 1]) >= profile.hot_threshold)
        branch = None
        if matches and profile.branch_guard > 0:
            branch, matches = self._branch(request, snapshot, matches, deepest)
        over: Mapping[str, int] = {}
        copying: Mapping[str, int] = {}
        stale: Mapping[str, str] = {}
        if matches and branch is None and profile.volume_guard > 0:
            matches, over, copying, stale = self._volume(request, snapshot, matches, deepest)
        anchor = request.key.anchor if branch is None else branch
        dropped: dict[str, str] = dict.fromkeys(exclude, "failed")
        limit = profile.candidate_limit
        candidates: list[WorkerView] | None = None
        if limit and len(snapshot.workers) > limit + len(matches) + len(exclude):
            few, pool_load = self._narrow(anchor, snapshot, matches, exclude, limit)
            ctx = Context(request, snapshot, matches, pool_load=pool_load, hot=hot,
                          branch_anchor=branch)
            try:
                candidates = self._filter(ctx, few, dropped)
            except NoCandidates:  # the few were all filtered out: look at everyone
                dropped = dict.fromkeys(exclude, "failed")
        if candidates is None:
            ctx = Context(request=request, snapshot=snapshot, matches=matches, hot=hot,
                          branch_anchor=branch)
            everyone = [w for w in snapshot.workers if w.id not in exclude]
            candidates = self._filter(ctx, everyone, dropped)
        totals: dict[str, float] = {w.id: 0.0 for w in candidates}
        for scorer, weight in profile.scorers:
            for wid, s in scorer.score(ctx, candidates).items():
                # Each score clamped to [0, 1] (inline: once per candidate and scorer).
                totals[wid] += weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s)
        if over and max(over.values()) > max((matches.get(w.id, 0) for w in candidates),
                                             default=0):
            # the volume guard moved the session
            chosen, how = self._move(ctx, candidates, max(over.values()))
        else:
            chosen, how = profile.picker.pick(ctx, candidates, totals)
        decision = self._decision(ctx, chosen, how, dropped, totals, over, known)
        if chosen.id in copying:
            copied = self._copy(ctx, decision, candidates, copying[chosen.id],
                                stale.get(chosen.id, ""))
            if copied is not None:
                return copied
            # Its stale copy cannot be brought up to date now: the session moves to it.
            over = {chosen.id: copying[chosen.id]}
            chosen, how = self._move(ctx, candidates, over[chosen.id])
            return self._decision(ctx, chosen, how, dropped, totals, over, known)
        return decision

    def _matches(
        self, request: RouteRequest, snapshot: Snapshot
    ) -> tuple[dict[str, int], int, int]:
        """Known holders of at least ``min_match_blocks`` of the prefix (worker -> depth in
        blocks), how many checkpoints of the key the deepest of them holds, and the depth in
        blocks of the deepest prefix any worker holds (no minimum)."""
        profile = self.profile
        if not profile.uses_prefix_index:
            return {}, 0, 0
        key = request.key
        floor = profile.min_match_blocks
        matches: dict[str, int] = {}
        deepest = known = 0
        depths = key.depths  # key.depth_at(count - 1), inline: once per holder
        for wid, count in snapshot.index.match(key.blocks).items():
            depth = depths[count - 1] if depths else count
            if depth > known:
                known = depth
            if depth >= floor:
                matches[wid] = depth
                if count > deepest:
                    deepest = count
        return matches, deepest, known

    def _branch(
        self, request: RouteRequest, snapshot: Snapshot, matches: dict[str, int], deepest: int
    ) -> tuple[int | None, dict[str, int]]:
        """Whether ``request`` branches off a shared trunk: the ring anchor past the trunk (or
        None) and the matches that still count.

        The deepest known prefix of the request (``deepest`` checkpoints) is a *trunk* when a
        recorded prompt went on past it along another path: a system or tool prompt that
        sessions share, not the end of the conversation this request extends. When the trunk
        is less than half of the prompt, where the rest goes is a new placement: the part
        past the trunk is what the worker will hold and what the session's next requests
        extend. The trunk's holders are the same few workers for every session and would
        gather all of them for a saving of less than half a prompt, while the trunk is soon
        cached wherever sessions go. So a holder that already has more than ``branch_guard``
        times its share of the pool's recent requests gets no credit for the trunk; when no
        holder is left, the request is placed like a cold prefix from its own ring position
        past the trunk. A prompt that is mostly the trunk (a shared prompt with a short
        question) stays with the trunk's holders, and so does every request that extends its
        own history. So does a request off a trunk whose branches do not grow
        (``branches_grow``: later requests reused what went on from it more often than they
        extended it, as questions on a shared document after a system prompt do): there the
        part past the trunk is shared content that is worth keeping with the trunk, not a
        session of its own."""
        key = request.key
        depth = key.depth_at(deepest - 1)
        index = snapshot.index
        trunk = key.blocks[deepest - 1]
        if (2 * depth >= key.total_blocks or not index.branched(trunk)
                or not index.branches_grow(trunk)):
            return None, matches
        fair = self.profile.branch_guard * index.pool_recent_requests() / _pool_weight(snapshot)
        by_id = snapshot.by_id
        holders = busy = 0
        for wid, d in matches.items():
            if d >= depth:
                holders += 1
                if index.recent_requests(wid) > fair * _weight(by_id, wid):
                    busy += 1
        if busy == holders:
            return key.anchor_past(depth), matches
        if busy:
            matches = {wid: d for wid, d in matches.items() if d < depth
                       or index.recent_requests(wid) <= fair * _weight(by_id, wid)}
        return None, matches

    def _volume(
        self, request: RouteRequest, snapshot: Snapshot, matches: dict[str, int], deepest: int
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, str]]:
        """The matches that keep their credit under the volume guard, those that lose it,
        and (``volume_copy``) those that keep it only until a copy of the session is made.

        Sessions stick to the worker that holds their history, so a worker's load over a
        minute is the sessions it was given, and one long-context session can be most of a
        worker's load: on long agent sessions a few workers each take twice the mean prompt
        volume while others idle, although the requests in flight at any instant look even
        (a session has one request in flight at a time). Bounded loads on the *recent*
        routed volume (prompt blocks recorded for the worker, cached or not, halved every
        ``heat_half_life_s``) with a hysteresis: a holder keeps its credit while its recent
        blocks plus this request's are within ``volume_guard`` times its share of the pool's
        (this request's included) plus ``VOLUME_SLACK`` times this request's blocks. A move
        redoes the held part of them elsewhere, so it is made only for an excess of more
        than that; the slack also lets the worker a session moves to take it and its next
        turns before its own bound trips, so a moved session does not bounce back, and it
        keeps the bound from tripping while the pool has recorded only a few requests. A
        holder without credit is treated as not holding the prefix; when it held the most of
        it, the session moves where :meth:`_move` finds room, reported ``DIVERTED`` by
        ``volume_guard``. Only a session that has
        routed at least ``VOLUME_SESSION_SHARE`` (half) of a worker's fair share recently,
        this request included (``PrefixMatcher.session_blocks``), is moved; a session with
        ``VOLUME_MEDIUM_SHARE`` (a fifth) of it only when another holder of part of its prompt
        (the trunk it shares) has room for the request within ``volume_guard`` times its
        share, so the move redoes only the session's own part. Those medium sessions make
        the excess of the trunk's holders, where new sessions keep starting: moving only the
        heavy ones left such a holder at 1.4-1.5 times the mean volume on agent sessions.
        Lighter sessions are balanced by where new sessions are placed: moving one costs a
        prefill for little of the excess (on multi-turn chat, moving them cost 2 points of
        hit rate for balance no target asked for). Only for a request that extends the
        prompt its deepest
        known prefix ends (``PrefixMatcher.extends``: a session's next turn): requests
        sharing a system prompt or a document from inside are not a session, a copy of what
        they share moves no load, and they spread only when waiting on the holder costs more
        than the prefill (``cache_cost``).

        With ``volume_copy`` a holder over its bound loses its credit only when another
        holder of at least ``VOLUME_COPY_SHARE`` of what it holds keeps its own credit
        (within its bound and the slack: its volume counts the copy already): the session
        moves to its copy (:meth:`_move`) and little is redone on the request's path (a
        copy at a background priority is recorded once it answered, by when the holder has
        usually been given the session's next turn: the copy lacks that turn). With
        ``volume_refresh`` a copy recorded when it was sent counts only when it holds all
        that the holder does; one that lacks turns the holder has had since is brought up
        to date first: the holder keeps the session, and the fourth mapping names that
        copy's worker, where :meth:`_copy` sends the new copy. A holder over its bound
        but within the slack keeps the session, unless another holder of all of it (a whole
        copy recorded at its send) has room: the slack waits for an excess worth a move's
        prefill, and a move to a whole copy redoes nothing.
        Without such a copy the holder keeps the session (returned as the third mapping)
        and the decision names where to copy it (:meth:`_copy`); a later turn finds the
        copy. When several holders are over their bound (a copy made earlier, its worker
        loaded since), only one keeps the session: the deepest, and of equals the lightest
        by recent volume per unit of weight; the others lose their credit."""
        index = snapshot.index
        key = request.key
        if deepest >= len(key.blocks) or not index.extends(key.blocks[deepest - 1],
                                                            key.depth_at(deepest)):
            return matches, {}, {}, {}  # not a session's next turn
        size = key.total_blocks
        share = _volume_share(snapshot, size)
        guard = self.profile.volume_guard
        slack = VOLUME_SLACK * size
        by_id = snapshot.by_id
        # Each holder read once: its weight, whether it keeps its credit (within its bound
        # and the slack) and whether it has room (within its bound): the loop below asks
        # these of every other holder, for each holder over its bound.
        weights: dict[str, float] = {}
        within: set[str] = set()
        room: set[str] = set()
        for wid in matches:
            weight = weights[wid] = _weight(by_id, wid)
            used, bound = index.recent_blocks(wid) + size, guard * share * weight
            if used <= bound:  # as _has_room()
                room.add(wid)
            if used <= bound + slack:
                within.add(wid)
        copy = self.profile.volume_copy
        refresh = copy and self.profile.volume_refresh
        if len(within) == len(matches) and (not refresh or len(room) == len(matches)):
            return matches, {}, {}, {}
        session = index.session_blocks(key.blocks[deepest - 1]) + size
        kept: dict[str, int] = {}
        over: dict[str, int] = {}
        copying: dict[str, int] = {}
        stale: dict[str, str] = {}
        # The most of the prompt a holder with room holds as a copy recorded at its send:
        # read once, not per holder over its bound (the trunk's holders can be the pool).
        whole = max((matches[other] for other in room
                     if not _copies_yield(snapshot, other)), default=-1) if refresh else -1
        for wid, depth in matches.items():
            fair = share * weights[wid]
            heavy = session >= VOLUME_SESSION_SHARE * fair or (
                session >= VOLUME_MEDIUM_SHARE * fair
                and len(room) > (wid in room))  # another holder has room
            if wid in within:
                # Over its bound but within the slack: kept, unless another holder of all of
                # it has room (a whole copy, recorded at its send): a move there redoes
                # nothing, which is what the slack waits for.
                if heavy and wid not in room and whole >= depth:
                    over[wid] = depth
                else:
                    kept[wid] = depth
            elif heavy:
                # Moved when no copy is asked for, or when another holder of (nearly) as
                # much of the prompt keeps its credit (where :meth:`_move` takes it): with
                # refreshes, one holding all of it or recorded only once it answered.
                copies = [other for other in within
                          if matches[other] >= VOLUME_COPY_SHARE * depth] if copy else []
                if not copy or (copies and not refresh) or any(
                        matches[other] >= depth or _copies_yield(snapshot, other)
                        for other in copies):
                    over[wid] = depth
                else:
                    kept[wid] = copying[wid] = depth
                    if copies:  # it lacks the turns its holder had since: brought up to date
                        stale[wid] = max(copies, key=lambda other: (matches[other], other))
            else:
                kept[wid] = depth
        if len(copying) > 1:
            # Holders over their bound keep the session only until a copy within its bound
            # exists, and meanwhile one of them keeps it: the deepest, the lightest of equals.
            # Left to the queue-based cost, the session went to whichever was idle, the
            # heavier as often as not (a copy made earlier, the worker since loaded).
            keep = min(copying, key=lambda wid: (
                -copying[wid], index.recent_blocks(wid) / (weights[wid] or 1.0), wid))
            for wid, depth in copying.items():
                if wid != keep:
                    del kept[wid]
                    over[wid] = depth
            copying = {keep: copying[keep]}
            stale = {keep: stale[keep]} if keep in stale else {}
        return kept, over, copying, stale

    def _move(self, ctx: Context, candidates: Sequence[WorkerView],
              held: int) -> tuple[WorkerView, str]:
        """Where a session the volume guard moved goes: the worker that can take the most of
        its next turns. Of the candidates holding part of its prompt (the trunk it shares, or
        an earlier part of the session) with room for this request within ``volume_guard``
        times their share of the pool's recent volume, the one holding the most, the least
        loaded by volume among equals; with none, the candidate with the least recent volume
        per unit of weight.

        With ``volume_copy`` the session's copy comes first: of the candidates holding at
        least ``VOLUME_COPY_SHARE`` of what its holder holds (``held``) within their bound
        and the slack, the one holding the most, the lightest of equals.

        Placed like a cold prefix instead (its ring position), a moved session landed on a
        worker near its own bound as often as not, tripped the guard there a few turns later
        and moved again: on long agent sessions the heaviest moved 5-9 times per window, each
        move a prefill of its whole history; while sessions start, when every first prompt
        joins the shared prefix's few holders, the guard moved sessions over a hundred times
        in 400 requests."""
        snapshot = ctx.snapshot
        index = snapshot.index
        size = ctx.request.key.total_blocks
        share = _volume_share(snapshot, size)
        guard = self.profile.volume_guard
        matches = ctx.matches

        lightest = _by_volume(ctx)
        if self.profile.volume_copy:
            # The session's copy: a holder of nearly as much as its holder (``held``) within
            # its own bound and the slack, as :meth:`_volume` found it (its volume counts the
            # copy already).
            slack = VOLUME_SLACK * size
            copies = [w for w in candidates if matches.get(w.id, 0) >= VOLUME_COPY_SHARE * held
                      and index.recent_blocks(w.id) + size
                      <= guard * share * w.worker.weight + slack]
            if copies:
                most = max(matches[w.id] for w in copies)
                return (min((w for w in copies if matches[w.id] == most), key=lightest),
                        "volume: its copy")
        room = [w for w in candidates if matches.get(w.id, 0)
                and _has_room(index, w.id, w.worker.weight, size, share, guard)]
        if room:
            most = max(matches[w.id] for w in room)
            chosen = min((w for w in room if matches[w.id] == most), key=lightest)
            return chosen, "volume: holder with room"
        return min(candidates, key=lightest), "volume: least recent volume"

    def _copy(self, ctx: Context, decision: Decision, candidates: Sequence[WorkerView],
              depth: int, stale: str = "") -> Decision | None:
        """``decision`` kept a session on a holder over the volume guard (``volume_copy``):
        the same decision, naming the worker to copy the session's prompt to. Of the
        candidates that hold less of it and either run copies at background priority
        (``WorkerView.copies_yield``) or are not making another copy (``WorkerView.copies``)
        and have no prefill queued, the one with the least recent volume per unit of weight,
        then the first in ring order from the request's anchor; with none such, no copy now
        (the session stays, and its next turn asks again).

        ``stale``: the worker of an earlier copy of the session that lacks the turns its
        holder had since (``volume_refresh``). The copy goes there, where only those turns
        are computed, and the session's next turn moves to it having lost at most the last
        answer; moved at once, the turn redid every turn the copy lacked on its own path
        (agent sessions with seconds between turns: 20-74 blocks of a 200-370 block prompt
        on half of the moves). When that worker cannot take a copy now, None: the session
        moves to its copy as it is.

        A copy is a prefill of the session's whole history, made with capacity nothing else
        uses: sent where other prompts are being prefilled (the holders of the trunk new
        sessions start from, several copies to the one worker with the least volume, or the
        worker with the least prefill queued while every worker had some) it and they shared
        the engine's compute, and the requests there waited for all of them (agent sessions
        on engines whose prefills share compute: p99 1.3-1.5x that of sessions kept whole;
        copying only to an idle worker, 0.7-1.0x). An engine that runs the copy at
        background priority gives it only the capacity its requests leave: there it slows no
        request, and waiting for an idle worker only made the session move later (agent
        sessions, simulated on the live runs' timing: routed max/mean 1.38 -> 1.26, p99 time
        to first token 265 -> 254 ms).

        Elsewhere a copy is made only while the pool has capacity to spare: at most
        ``COPY_BUSY_SHARE`` (a quarter) of its healthy workers with prefill queued, requests
        waiting or a copy under way. An idle worker in a busy pool does not stay idle for the
        length of a copy: requests placed there meanwhile shared its compute, and a turn moved
        to the copy waited for it (agent sessions back to back, with a decision finding about
        half of the workers busy: p99 1.18x that of sessions kept whole). With seconds between
        turns (3-6% of the workers busy at a decision) copies are made as before, during the
        sessions' think time, and cost no p99 (BENCHMARKS.md, "the ring off the request path,
        agents with seconds between turns")."""
        others = [w for w in candidates if ctx.matches.get(w.id, 0) < depth and (
            w.copies_yield or (not w.copies and not w.inflight_prefill))]
        healthy = [w for w in ctx.snapshot.workers if w.healthy]
        busy = sum(1 for w in healthy if w.inflight_prefill or w.waiting_requests or w.copies)
        if busy > COPY_BUSY_SHARE * len(healthy):
            # No capacity to spare: only an engine that yields to its requests takes a copy.
            others = [w for w in others if w.copies_yield]
        if stale:
            if all(w.id != stale for w in others):
                return None
            return dataclasses.replace(decision, copy_to=stale)
        if not others:
            return decision
        return dataclasses.replace(decision, copy_to=min(others, key=_by_volume(ctx)).id)

    @staticmethod
    def _narrow(
        anchor: int,
        snapshot: Snapshot,
        matches: Mapping[str, int],
        exclude: frozenset[str],
        limit: int,
    ) -> tuple[list[WorkerView], tuple[int, float]]:
        """The holders plus the first ``limit`` healthy workers on the ring from ``anchor``,
        and the pool-wide load the bound needs. O(holders + limit) when the snapshot carries
        ``by_id`` and ``pool_load``; one pass over the workers otherwise."""
        by_id = snapshot.by_id
        if by_id is None:
            by_id = {w.id: w for w in snapshot.workers}
        if snapshot.pool_load is None:
            healthy = [w for w in by_id.values() if w.healthy and w.id not in exclude]
            pool_load = (
                sum(w.inflight_tokens for w in healthy), sum(w.worker.weight for w in healthy)
            )
        else:
            tokens, weight = snapshot.pool_load
            for wid in exclude:
                view = by_id.get(wid)
                if view is not None and view.healthy:
                    tokens -= view.inflight_tokens
                    weight -= view.worker.weight
            pool_load = (tokens, weight)

        def usable(wid: str) -> WorkerView | None:
            view = by_id.get(wid)
            return view if view is not None and view.healthy and wid not in exclude else None

        chosen = {wid: v for wid in matches if (v := usable(wid)) is not None}
        wanted = len(chosen) + limit
        for wid in snapshot.ring.walk(anchor):
            if wid not in chosen and (view := usable(wid)) is not None:
                chosen[wid] = view
                if len(chosen) >= wanted:
                    break
        return list(chosen.values()), pool_load

    def _filter(
        self, ctx: Context, candidates: list[WorkerView], dropped: dict[str, str]
    ) -> list[WorkerView]:
        for flt in self.profile.filters:
            kept = flt.apply(ctx, candidates)
            if not kept:
                raise NoCandidates(f"no worker left after filter {flt.name}")
            if len(kept) != len(candidates):
                kept_ids = {w.id for w in kept}
                for w in candidates:
                    if w.id not in kept_ids:
                        dropped[w.id] = flt.name
            candidates = kept
        return candidates

    def _decision(
        self,
        ctx: Context,
        chosen: WorkerView,
        how: str,
        dropped: Mapping[str, str],
        totals: Mapping[str, float],
        over_volume: Mapping[str, int],
        known: int = 0,
    ) -> Decision:
        profile = self.profile
        depth = ctx.matches.get(chosen.id, 0)
        holder, holder_blocks, why = "", 0, ""
        if ctx.branch_anchor is not None:
            kind = DecisionKind.BRANCH
            holder = max(ctx.matches, key=lambda wid: ctx.matches[wid])
            holder_blocks = ctx.matches[holder]
        elif over_volume and max(over_volume.values()) > depth:
            # A holder of more lost its credit to the volume guard: the session moved.
            kind = DecisionKind.DIVERTED
            holder = max(over_volume, key=lambda wid: over_volume[wid])
            holder_blocks, why = over_volume[holder], "volume_guard"
        elif depth > 0:
            kind = DecisionKind.PREFIX_HIT
        elif not ctx.matches:
            kind = DecisionKind.COLD if profile.uses_prefix_index else DecisionKind.PLACED
        else:
            holder = max(ctx.matches, key=lambda wid: ctx.matches[wid])
            holder_blocks = ctx.matches[holder]
            why = dropped.get(holder, "outscored")
            # Filtered out (its load bound, a failure): diverted. Outscored by a worker that
            # must redo the prefill: waiting on the holder cost more, the prefix spreads.
            kind = DecisionKind.SPREAD if why == "outscored" else DecisionKind.DIVERTED
        return Decision(
            worker=chosen, policy=profile.name, kind=kind, match_blocks=depth, placement=how,
            picker=profile.picker.name, holder=holder, holder_blocks=holder_blocks,
            diverted_by=why, scores=totals, load_bound=ctx.load_bounds.get(chosen.id),
            known_blocks=max(known, depth),
        )
