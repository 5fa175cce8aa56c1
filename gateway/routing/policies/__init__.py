"""Named routing policies: each is a profile of filters, weighted scorers and a picker.

=================  ==========================================  ==========================
policy             filters                                     scorers -> picker
=================  ==========================================  ==========================
round_robin        healthy, model                              round robin
least_load         healthy, model                              load -> best (ring ties)
consistent_hash    healthy, model                              ring owner of the anchor
bounded_hash       healthy, model, bounded_load(c)             ring walk from the anchor
prefix_affinity    healthy, model, bounded_load(c)             prefix_match -> best (ring)
cache_aware        healthy, model, bounded_load(c_guard)       cache_cost -> spread (k ring)
=================  ==========================================  ==========================

``prefix_affinity`` sends a request to the worker holding its longest known prefix; a cold
prefix (no holder) scores 0 everywhere and falls to the ring walk, i.e. ``bounded_hash``; a
holder over the load bound is filtered out, so the request goes to the next-best holder or, if
none, to the ring, and the new worker becomes a second holder of the prefix.

``cache_aware`` (the default) replaces the longest-match switch with one cost per worker,
the prefill it would have to compute against the queue it has (see ``cache_cost``): a holder
keeps its prefix until waiting on it costs more than the prefill a move adds, counted with what
that prefill evicts (as much as the worker's cache is full) and the pool's queue it delays. A
request count never spreads a prefix by itself: with zero service time or tight caches a copy
only duplicates the prefix and evicts others. A cold prefix (no worker holds
``min_match_blocks`` of it) goes to one of the first ``ring_choices`` workers on the ring from
its anchor, the one where it costs least (``spread_picker``): fewest recent requests for a short
prompt, slowest cache turnover (while none is full, the emptiest cache) for a long one,
skipping any with far more in flight. Placement stays tied to the anchor, so replicas mostly
agree, and both the request counts and the caches' eviction even out. The hard
bound is a loose guard, ``cache_aware_load_factor`` (3 x mean): an instantaneous token bound of
1.25 x mean sends away a quarter of the hits on real traffic, while the cost and the ring
choices already keep the cumulative load within 1.1 x mean (BENCHMARKS.md). It guards only
workers whose engines make requests wait: one that reports giving its recent requests their
first token within ``quick_first_token_s`` (20 ms) on average is exempt, since a request
diverted from it would lose its cache hit and start no sooner.
A request that *branches off a shared trunk* (its deepest known prefix is a prompt others went
on past along other paths, e.g. an agent's tool and system prompt, and it is less than half of
the request) is a new placement: its holders that already have more than ``branch_guard``
(1.25) times their share of the recent requests get no credit for the trunk, and with none
left the request is placed like a cold prefix, from the ring anchor past the trunk
(``DecisionKind.BRANCH``), so sessions that share only the trunk do not all gather on the
trunk's few holders. That holds only for a trunk whose branches grow (the index learns it per
trunk: later requests extended what went on from it, as sessions' next turns do, at least as
often as they reused it from inside, as questions on a shared document do); the branches of a
trunk they reuse stay with the trunk. When each of a branch's ring choices has a prefill
queued (``walk_past_queued``), it goes to a worker further along the ring with none, unless
the trunk the choices hold costs more prefill than that wait: agents' new sessions doubled up
on one worker while others idled, their first turns setting the p99 (a cold prefix, which may
be a document many requests will share, keeps its choices). *Volume* (``volume_guard``, 1.1
by default): sessions stick to
their worker, so a worker's routed volume over a minute is the sessions it was given, and one
long-context session can be twice a worker's mean prompt volume while its requests in flight
look like anyone's. A holder whose recent routed prompt blocks (cached or not, halved every
30 s) are over ``volume_guard`` times its share of the pool's, by more than twice the request,
gets no credit for a request that extends a prompt it holds (a session's next turn; not for
prompts shared from inside, whose copies move no load), when the session itself routed at
least half a worker's share recently, or a fifth of it when another holder of part of its
prompt (the trunk it shares) has room for the request (lighter sessions are balanced by where
new ones are placed). With ``volume_copy`` (the default) the session moves only to a worker
that already holds as much of it and is within its own bound: until one does, its holder
keeps it and the decision names where to copy it (``Decision.copy_to``: of the workers holding
less of it with no prefill queued and no other copy under way, or however busy where the
engine runs copies at background priority (``WorkerView.copies_yield``), the one with the
least recent volume; with none, no copy yet), and the pre-warmer sends its whole prompt there as a
prefill-only request, so its next turn moves without redoing its history on a request's path.
On agent sessions that keeps the hit rate of sessions kept whole (0.996-0.998 of the bound)
at routed volume 1.20-1.28x the mean instead of 1.6-3.2x (BENCHMARKS.md, "the volume guard
moves a session by copying it first"; "the guard at 1.1"). Without copies the session moves at once
(``DecisionKind.DIVERTED`` by ``volume_guard``), paying one prefill of its history, to the
worker that can take the most of its next turns: the holder of most of its prompt among those
with room within ``volume_guard`` times their share, else the worker with the least recent
volume; that cost agent sessions 5 points of hit rate and, on engines whose prefills share
compute, 1.4-1.7x p99. An engine caches a block when it begins computing it (vLLM), and
admits a copy ahead of the requests routed after it: a session's next turn moved to its copy
reuses it, waiting for the rest of its computation. A copy at a background priority
(``copy_priority``) may not have begun when that turn comes, so it counts as held only once
it answered (``WarmPrompt.recorded_at_answer``); then a holder of three quarters of what the
session's holder holds, within its bound and the slack, counts as its copy (the holder has
had its next turn meanwhile). One copy per session is under way at a time. On agent sessions
that wait for each answer, on engines of that rule, the guard at 1.1 gave 0.992-0.996 of the
bound at 1.18-1.28x the mean volume against 0.996-0.997 at 1.5-2.9x without it, and p99
3-37% higher by window (a turn moved to a copy still being computed waits for it; the copies'
prefills shared the compute of the requests placed beside them; BENCHMARKS.md, "the volume
guard on engines that reuse a block once begun"). So a copy is made only while at most a
quarter of the pool's workers has prefill queued (``COPY_BUSY_SHARE``; an engine running
copies at background priority takes one however busy): back to back, with half the workers
busy at a decision, hardly any copy is made and the routing is that of sessions kept whole;
with seconds between turns, as agents take them (3-6% of the workers busy), the copies are
made during the sessions' think time and the guard balances them to 1.3x the mean volume at
no p99 cost (BENCHMARKS.md, "the ring off the request path, agents with seconds between
turns"). A copy recorded when it was sent that lacks turns its holder has had since (made
some turns before the session's holder tripped its bound again, or on a worker the session
left) is copied again first (``volume_refresh``): the copy goes to that worker, which computes
only the turns it lacks, the holder keeps this turn, and the next moves to a copy holding all
the index knows of the session (moved at once, the turn redid those turns on its own path).
When that worker cannot take a copy now, the session moves to the copy as it is. A holder
over its bound but within the slack loses the session to another holder of all of it with
room: the slack waits for an excess worth a move's prefill, and a move to a whole copy
redoes nothing. Agent sessions with seconds between turns, skip 2000: 0.9930 @ 1.33 ->
0.9967 @ 1.20 of the bound and the mean volume (BENCHMARKS.md, "stale session copies
brought up to date before a session moves"). The guard credits a
holder with the prefill a move would redo (its bound grows by the prompt tokens it holds for
the request): a conversation is not moved off its worker because its own earlier
turns are in flight there. Its bound also grows by the cached
context of the other prompts it has in flight (not of those that share the part it holds of this
one): other sessions' long histories served from its cache do not send a session away from its
own, while a hot prompt piling up there still spreads.
``hot_threshold`` > 0 brings back the older rule (a prefix that many recent requests share gets
the tight ``hot_load_factor`` bound, so its holder overflows to a second holder); it is off by
default. Defaults live in :class:`PolicyOptions`; every field is a gateway setting of the same
name.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing.engine import Profile, RoutingEngine
from gateway.routing.policies.bounded_load import BoundedLoadFilter
from gateway.routing.policies.cache_cost import CacheCostScorer
from gateway.routing.policies.healthy import HealthyFilter, ModelFilter
from gateway.routing.policies.load import LoadScorer
from gateway.routing.policies.prefix_match import PrefixMatchScorer
from gateway.routing.policies.ring_picker import RingPicker
from gateway.routing.policies.round_robin import RoundRobinPicker
from gateway.routing.policies.spread_picker import SpreadPicker

POLICY_NAMES = (
    "cache_aware",
    "prefix_affinity",
    "bounded_hash",
    "consistent_hash",
    "least_load",
    "round_robin",
)


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    load_factor: float = 1.25  # bounded_hash and prefix_affinity
    load_floor_requests: float = 1.0
    # cache_aware: its cost and the ring choices balance the load, so its hard bound is only
    # a guard against hot spots.
    cache_aware_load_factor: float = 3.0
    prefill_weight: float = 1.0
    queue_weight: float = 0.01
    wait_weight: float = 1.0  # cache_aware: prefill queued on a worker, against prefill saved
    evict_weight: float = 1.0  # cache_aware: prefill costs 1 + w x the cache's fill (evictions)
    min_match_blocks: int = 2
    ring_choices: int = 4
    spread_guard: float = 1.5  # cache_aware: skip choices over 1.5 x their mean in flight
    pressure_weight: float = 4.0  # cache_aware: cache turnover against recent requests
    # cache_aware: when each ring choice for a new session off a shared trunk would make it
    # wait (a prefill queued), a worker further along the ring with none, if what it must
    # prefill more (the trunk the choices hold) is less than that wait.
    walk_past_queued: bool = True
    candidate_limit: int = 16
    # Requests sharing a prefix (halved every 30 s) to call it hot; 0: never (a prefix spreads
    # only when waiting on its holder costs more than the prefill elsewhere: wait_weight).
    hot_threshold: float = 0.0
    hot_load_factor: float = 1.25  # cache_aware's bound for hot prefixes
    # cache_aware: for a request that branches off a shared trunk with most of its prompt, a
    # trunk holder with more than this x its share of the recent requests gets no credit for
    # the trunk; with none left the request is placed as a cold prefix from the ring position
    # past the trunk. The bounded-load factor's 1.25; 0: never.
    branch_guard: float = 1.25
    # cache_aware: a holder whose recent routed prompt blocks (cached or not) are over this x
    # its share of the pool's, by more than twice the request's blocks, gets no credit for a
    # session's next turn, when the session routed at least half a worker's share: one long
    # session cannot make a worker's volume. Its copies are made only while the pool has
    # capacity to spare (engine.COPY_BUSY_SHARE). 1.1 (the default): agent sessions with
    # seconds between turns at 1.3x the mean volume instead of 1.9x, for 0.003 of hit rate
    # and no p99; back to back it makes no copies (BENCHMARKS.md, "the ring off the request
    # path, agents with seconds between turns"). 0: never.
    volume_guard: float = 1.1
    # cache_aware, with the volume guard: a session over it moves only to a worker holding a
    # copy of its prompt, which the pre-warmer makes while its holder keeps serving it (no
    # prefill on a request's path); False: it moves at once and the request redoes its history.
    volume_copy: bool = True
    # cache_aware, with copies: an earlier copy of a session that lacks turns its holder has
    # had since is copied again (only those turns computed there) before the session moves
    # to it, so the move redoes at most the last answer, and a whole copy with room takes
    # the session from a holder over its bound within the slack; False: the session moves to
    # a copy of three quarters as it is, redoing the turns it lacks on a request's path.
    volume_refresh: bool = True
    # cache_aware: a worker whose engine's recent requests got their first token within this
    # many seconds on average is exempt from the hard bound (tokens in flight there make
    # nobody wait as long as a prefill elsewhere takes); gateway.pool.QUEUE_FLOOR_S. 0: never.
    quick_first_token_s: float = 0.02

    def __post_init__(self) -> None:
        if min(self.load_floor_requests, self.hot_threshold, self.candidate_limit,
               self.min_match_blocks, self.branch_guard, self.quick_first_token_s) < 0:
            raise ValueError("load_floor_requests, hot_threshold, candidate_limit, "
                             "min_match_blocks, branch_guard and quick_first_token_s must be >= 0")
        if self.volume_guard != 0 and self.volume_guard < 1:
            raise ValueError("volume_guard must be 0 (off) or >= 1")


def build_engine(name: str, opts: PolicyOptions = PolicyOptions()) -> RoutingEngine:
    """A fresh engine for policy ``name`` (each has its own picker state)."""
    base = (HealthyFilter(), ModelFilter())
    bounded = (*base, BoundedLoadFilter(opts.load_factor, opts.load_floor_requests))
    match name:
        case "round_robin":
            profile = Profile(name, base, (), RoundRobinPicker())
        case "least_load":
            profile = Profile(name, base, ((LoadScorer(), 1.0),), RingPicker())
        case "consistent_hash":
            profile = Profile(name, base, (), RingPicker())
        case "bounded_hash":
            profile = Profile(name, bounded, (), RingPicker())
        case "prefix_affinity":
            profile = Profile(
                name, bounded, ((PrefixMatchScorer(), 1.0),), RingPicker(), uses_prefix_index=True
            )
        case "cache_aware":
            scorer = CacheCostScorer(
                opts.prefill_weight, opts.queue_weight, opts.wait_weight, opts.evict_weight
            )
            guard = BoundedLoadFilter(
                opts.cache_aware_load_factor, opts.load_floor_requests, opts.hot_load_factor,
                match_credit=True, quick_s=opts.quick_first_token_s,
            )
            profile = Profile(
                name, (*base, guard), ((scorer, 1.0),), SpreadPicker(
                    opts.ring_choices, opts.spread_guard, opts.pressure_weight,
                    opts.walk_past_queued, opts.quick_first_token_s,
                ),
                uses_prefix_index=True, min_match_blocks=opts.min_match_blocks,
                candidate_limit=opts.candidate_limit, hot_threshold=opts.hot_threshold,
                branch_guard=opts.branch_guard, volume_guard=opts.volume_guard,
                volume_copy=opts.volume_copy, volume_refresh=opts.volume_refresh,
            )
        case _:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return RoutingEngine(profile)
