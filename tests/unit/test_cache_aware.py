"""The cache_aware policy: one cost (prefill it cannot skip + queue) under the hard bound."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from gateway.fingerprint import PrefixKey
from gateway.routing.policies import PolicyOptions, build_engine
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import (
    Decision,
    DecisionKind,
    RouteRequest,
    Snapshot,
    Worker,
    WorkerView,
)

IDS = ("w0", "w1", "w2", "w3")
RING = Ring({wid: 1.0 for wid in IDS})
ANCHOR = next(a for a in range(1_000_000) if tuple(RING.walk(a)) == IDS)
BLOCKS = tuple(range(500, 510))  # 10 blocks


def _route(
    loads: Mapping[str, int],
    held: Mapping[str, int],
    prompt_tokens: int,
    opts: PolicyOptions | None = None,
    inflight: Mapping[str, tuple[tuple[tuple[int, ...], int], ...]] | None = None,
    waiting: Mapping[str, int] | None = None,
) -> tuple[str, str]:
    index = PrefixIndex()
    for wid, depth in held.items():
        index.record(BLOCKS[:depth], wid, 0.0)
    inflight = inflight or {}
    waiting = waiting or {}
    views = tuple(
        WorkerView(Worker(wid, f"http://{wid}"), True, 1 if loads.get(wid) else 0,
                   loads.get(wid, 0), inflight_prompts=inflight.get(wid, ()),
                   waiting_requests=waiting.get(wid, 0))
        for wid in IDS
    )
    request = RouteRequest(PrefixKey(BLOCKS, ANCHOR, 640), "m", prompt_tokens + 10, prompt_tokens)
    engine = build_engine("cache_aware", opts or PolicyOptions())
    decision = engine.route(request, Snapshot(views, index.at(0.0), RING))
    return decision.worker_id, decision.reason


CASES = [
    pytest.param({}, {}, 160, "w0", "cold -> ring", id="cold-goes-to-ring-owner"),
    pytest.param({"w0": 900}, {}, 160, "w1", "cold -> ring skip=1", id="cold-skips-over-bound"),
    pytest.param({}, {"w2": 10}, 160, "w2", "prefix_hit depth=10", id="full-holder-wins"),
    pytest.param({"w0": 100, "w1": 100, "w2": 150, "w3": 100}, {"w2": 10}, 160, "w2",
                 "prefix_hit depth=10", id="holder-with-longer-queue-still-wins"),
    pytest.param({"w1": 300, "w3": 50}, {"w1": 10, "w3": 10}, 400, "w3",
                 "prefix_hit depth=10", id="hot-prefix-least-loaded-holder"),
    pytest.param({}, {"w1": 4, "w3": 8}, 400, "w3", "prefix_hit depth=8",
                 id="deeper-holder-wins-when-idle"),
    pytest.param({}, {"w3": 1}, 400, "w0", "cold -> ring", id="one-block-match-is-cold"),
]


@pytest.mark.parametrize(("loads", "held", "prompt", "expected", "reason"), CASES)
def test_cache_aware_table(
    loads: Mapping[str, int], held: Mapping[str, int], prompt: int, expected: str, reason: str
) -> None:
    chosen, why = _route(loads, held, prompt)
    assert chosen == expected
    assert why == reason


@pytest.mark.parametrize(("queue_weight", "expected"), [(0.5, "w0"), (0.01, "w2"), (0.0, "w2")])
def test_queue_outweighs_the_saving_only_with_enough_queue_weight(
    queue_weight: float, expected: str
) -> None:
    # A prompt of 40 tokens: w2 saves 40 tokens of prefill but has 100 more tokens queued.
    chosen, _ = _route({"w2": 400, "w0": 300, "w1": 300, "w3": 300}, {"w2": 10}, 40,
                       PolicyOptions(queue_weight=queue_weight))
    assert chosen == expected


@pytest.mark.parametrize(("choices", "expected"), [(1, "w0"), (2, "w1"), (3, "w2")])
def test_cold_prefix_goes_to_the_lightest_of_the_first_k_on_the_ring(
    choices: int, expected: str
) -> None:
    loads = {"w0": 300, "w1": 200, "w2": 100, "w3": 0}
    chosen, why = _route(loads, {}, 40, PolicyOptions(ring_choices=choices))
    assert chosen == expected
    assert why.startswith("cold -> ring")


def test_over_bound_holder_is_never_chosen() -> None:
    # Total 1,550 in flight; w2's guard is 3 x 1/4 x (1,550 + 50) = 1,200, plus the 40 tokens
    # of prefill it saves (it holds the whole prompt): 1,240 < 1,250.
    chosen, why = _route({"w2": 1250, "w0": 100, "w1": 100, "w3": 100}, {"w2": 10}, 40)
    assert chosen != "w2"
    assert why.startswith("diverted: w2 bounded_load")


def test_hot_prefix_holder_gets_the_tight_bound_and_spreads() -> None:
    """A prefix many requests share is hot: its holder is bounded at 1.25 x mean, not 3 x."""
    loads = {"w0": 100, "w1": 100, "w2": 600, "w3": 100}  # w2: 600 > 1.25/4 x 950 = 297
    index = PrefixIndex()
    for _ in range(3):
        index.record(BLOCKS, "w2", 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}"), True, 1, loads[w]) for w in IDS)
    request = RouteRequest(PrefixKey(BLOCKS, ANCHOR, 640), "m", 50, 40)
    snap = Snapshot(views, index.at(0.0), RING)
    cold_ish = build_engine("cache_aware", PolicyOptions(hot_threshold=8.0)).route(request, snap)
    assert cold_ish.worker_id == "w2"  # 3 requests: not hot, the 3 x guard lets it stay
    for _ in range(6):
        index.record(BLOCKS, "w2", 0.0)
    hot = build_engine("cache_aware", PolicyOptions(hot_threshold=8.0)).route(request, snap)
    assert hot.worker_id != "w2"
    assert hot.reason.startswith("diverted: w2 bounded_load")
    # The same on engines that start requests at once: whoever turned the rule on asked for
    # hot prefixes to spread by count, so the quick engines' exemption does not apply to them.
    quick = tuple(dataclasses.replace(v, first_token_s=0.001) for v in views)
    quick_snap = Snapshot(quick, index.at(0.0), RING)
    engine = build_engine("cache_aware", PolicyOptions(hot_threshold=8.0))
    assert engine.route(request, quick_snap).reason.startswith("diverted: w2 bounded_load")


def _spread(prefill: Mapping[str, int], held: Mapping[str, int], prompt: int,
            full: bool = False) -> tuple[str, str]:
    """Route with queued prefill per worker (``WorkerView.inflight_prefill``)."""
    index = PrefixIndex()
    if full:  # every modelled cache full of other prefixes: a miss evicts
        for i, wid in enumerate(IDS):
            index.set_capacity(wid, 10)
            index.record(tuple(range(1000 * (i + 1), 1000 * (i + 1) + 10)), wid, 0.0)
    for wid, depth in held.items():
        index.record(BLOCKS[:depth], wid, 1.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}"), True, 1 if prefill.get(w) else 0, 0,
                             prefill.get(w, 0)) for w in IDS)
    request = RouteRequest(PrefixKey(BLOCKS, ANCHOR, 640), "m", prompt + 10, prompt)
    decision = build_engine("cache_aware").route(request, Snapshot(views, index.at(1.0), RING))
    return decision.worker_id, decision.reason


# Queued prefill Q per worker (tokens); w2 holds all 10 blocks of the prompt.
# cost = prefill * (1 + evict x fill) * (1 + sum Q / P) + (Q - min Q)   (T = 0 here)
SPREAD_CASES = [
    # Nobody queues: the holder wins, however many requests shared the prefix before.
    pytest.param({}, 400, "w2", id="idle-pool-stays-on-holder"),
    # Holder 1600 queued, the others 0. Holder: 0 + 1600. Others: 400 x (1 + 4) = 2000:
    # the holder still wins, a move adds more work than it saves.
    pytest.param({"w2": 1600}, 400, "w2", id="moderate-queue-stays"),
    # Holder 8000. Others: 400 x 21 = 8400: the busier the pool, the dearer every miss.
    pytest.param({"w2": 8000}, 400, "w2", id="busy-pool-miss-is-dear"),
    # A short prompt (40): others 40 x (1 + 200) = 8040 against the holder's 8000.
    pytest.param({"w2": 8000}, 40, "w2", id="short-prompt-stays"),
]


@pytest.mark.parametrize(("prefill", "prompt", "expected"), SPREAD_CASES)
def test_a_whole_prefix_stays_on_its_holder_unless_waiting_costs_more(
    prefill: Mapping[str, int], prompt: int, expected: str
) -> None:
    chosen, why = _spread(prefill, {"w2": 10}, prompt)
    assert (chosen, why) == (expected, "prefix_hit depth=10")


def test_a_partial_holder_spreads_when_its_queue_costs_more_than_the_prefill() -> None:
    # w2 holds 2 of 10 blocks (saves 20% of P = 1000). Queues: w2 9000, the others 0.
    # w2: 800 x (1 + 9) + 9000 = 17000; an idle worker: 1000 x 10 = 10000.
    chosen, why = _spread({"w2": 9000}, {"w2": 2}, 1000)
    assert chosen != "w2"
    assert why.startswith("spread: w2 outscored (depth=2)")
    # With the same queue everywhere (2250 each) it keeps its prefix.
    even = dict.fromkeys(IDS, 2250)
    assert _spread(even, {"w2": 2}, 1000) == ("w2", "prefix_hit depth=2")


def test_a_full_cache_makes_a_move_dearer() -> None:
    # w2 holds 5 of 10 blocks; queues w2 5000, others 0; P = 1000 (x 6).
    # Room everywhere: w2 500 x 6 + 5000 = 8000 > an idle worker's 1000 x 6 = 6000: moves.
    # Full caches: w2 500 x 2 x 6 + 5000 = 11000 < 1000 x 2 x 6 = 12000: stays.
    assert _spread({"w2": 5000}, {"w2": 5}, 1000)[0] != "w2"
    assert _spread({"w2": 5000}, {"w2": 5}, 1000, full=True)[0] == "w2"


def test_a_prefill_that_must_be_done_goes_where_the_least_is_queued() -> None:
    # w0 holds 2 of 10 blocks under a queue of 9000 and spreads; of the others, all busy
    # (w1 500, w2 100, w3 800 queued), w2 makes it wait least: every token queued ahead on an
    # engine whose prefills share compute slows it. Measured against the mean queue (2600),
    # all three looked equally idle and the ring's first, w1, took it.
    chosen, why = _spread({"w0": 9000, "w1": 500, "w2": 100, "w3": 800}, {"w0": 2}, 1000)
    assert (chosen, why.split(" -> ")[0]) == ("w2", "spread: w0 outscored (depth=2)")


def _with_fills(held: int, fills: Mapping[str, int]) -> tuple[str, str]:
    """Nobody queues; w2 holds ``held`` of the prompt's 10 blocks in a full cache of 10; every
    other worker's cache of 10 holds ``fills[w]`` blocks of other prefixes."""
    index = PrefixIndex()
    for i, wid in enumerate(IDS):
        index.set_capacity(wid, 10)
        used = 10 - held if wid == "w2" else fills[wid]
        if used:
            index.record(tuple(range(1000 * (i + 1), 1000 * (i + 1) + used)), wid, 0.0)
    index.record(BLOCKS[:held], "w2", 1.0)
    assert index.fill("w2") == 1.0
    views = tuple(WorkerView(Worker(w, f"http://{w}"), True, 0, 0) for w in IDS)
    request = RouteRequest(PrefixKey(BLOCKS, ANCHOR, 640), "m", 1010, 1000)
    decision = build_engine("cache_aware").route(request, Snapshot(views, index.at(1.0), RING))
    return decision.worker_id, decision.reason


def test_room_in_a_filling_cache_is_priced_by_its_fill() -> None:
    # w2 holds 4 of 10 blocks in a full cache: 600 x 2 = 1,200. Workers whose caches are
    # 8 / 10 full: 1,000 x 1.8 = 1,800. The holder keeps it: that room only defers an eviction.
    nearly_full = {"w0": 8, "w1": 8, "w3": 8}
    assert _with_fills(4, nearly_full) == ("w2", "prefix_hit depth=4")
    # An empty cache (a worker just added): 1,000 x 1 = 1,000 < 1,200: it is free room.
    chosen, why = _with_fills(4, {"w0": 8, "w1": 0, "w3": 8})
    assert chosen == "w1"
    assert why.startswith("spread: w2 outscored (depth=4)")


def test_the_policy_weights_are_validated() -> None:
    with pytest.raises(ValueError, match="weights"):
        build_engine("cache_aware", PolicyOptions(wait_weight=-1.0))
    with pytest.raises(ValueError, match="candidate_limit"):
        PolicyOptions(candidate_limit=-1)


# -- the load guard's credit for the prefill a move would redo ----------------------------------
# Three workers at 100 tokens in flight, w2 at ``load``; a 40-token prompt of 10 blocks (cost 50).
# Guard: 3 x 1/4 x (total + 50); w2's bound grows by 4 tokens per block it holds of the prompt.
GUARD_CASES = [
    # total 1,490: bound 1,155 + 40 (all 10 blocks held) = 1,195 >= 1,190: the holder keeps it.
    pytest.param(1190, 10, "w2", "prefix_hit depth=10", id="whole-prefix-holder-stays"),
    # The same load with 2 blocks held: 1,155 + 8 = 1,163 < 1,190: over the bound, diverted.
    pytest.param(1190, 2, "", "diverted: w2 bounded_load", id="shallow-holder-diverted"),
    # total 1,550: 1,200 + 40 = 1,240 < 1,250: the credit is only the prefill a move redoes.
    pytest.param(1250, 10, "", "diverted: w2 bounded_load", id="far-over-bound-diverted"),
]


OTHER_SESSIONS = (((900, 901, 902), 150), ((910, 911), 150))  # other prompts, 300 cached
SAME_PROMPT = ((BLOCKS, 150), ((*BLOCKS[:3], 920), 150))  # share the first 3 blocks only
ALLOWANCE_CASES = [
    # The far-over-bound case again (1,250 against 1,240), but 300 of w2's load is other
    # sessions' context it serves from its cache: 1,495 of bound, the session stays.
    pytest.param(10, OTHER_SESSIONS, "w2", "prefix_hit depth=10", id="others-cached-context"),
    # Prompts sharing what w2 holds of this one pile up there: no allowance, diverted.
    pytest.param(10, ((BLOCKS, 150), (BLOCKS, 150)), "", "diverted: w2 bounded_load",
                 id="the-same-prompt-piling-up"),
    # w2 holds 3 blocks of it; one request in flight shares those 3, the other shares all 10
    # of some prompt but so also the 3: neither is elsewhere. 1,155 + 12 < 1,250.
    pytest.param(3, SAME_PROMPT, "", "diverted: w2 bounded_load", id="sharing-the-held-part"),
]


@pytest.mark.parametrize(("depth", "inflight", "expected", "reason"), ALLOWANCE_CASES)
def test_a_holder_is_allowed_the_cached_context_of_other_prompts_in_flight(
    depth: int, inflight: tuple[tuple[tuple[int, ...], int], ...], expected: str, reason: str
) -> None:
    chosen, why = _route({"w2": 1250, "w0": 100, "w1": 100, "w3": 100}, {"w2": depth}, 40,
                         inflight={"w2": inflight})
    assert why.startswith(reason)
    assert (chosen == "w2") == (expected == "w2")


@pytest.mark.parametrize(("load", "depth", "expected", "reason"), GUARD_CASES)
def test_the_guard_credits_a_holder_with_the_prefill_it_saves(
    load: int, depth: int, expected: str, reason: str
) -> None:
    chosen, why = _route({"w2": load, "w0": 100, "w1": 100, "w3": 100}, {"w2": depth}, 40)
    assert why.startswith(reason)
    assert (chosen == "w2") == (expected == "w2")


# -- branches off a shared trunk ----------------------------------------------------------------
TRUNK = tuple(range(600, 604))  # a 4-block shared system prompt
OTHER = TRUNK + tuple(range(700, 712))  # another session on it, recorded on w1


def _branch_route(
    prompt: tuple[int, ...],
    recorded: tuple[tuple[tuple[int, ...], str], ...] = ((OTHER, "w1"),),
    opts: PolicyOptions | None = None,
    loads: Mapping[str, int] | None = None,
) -> Decision:
    index = PrefixIndex()
    for blocks, wid in recorded:
        index.record(blocks, wid, 0.0)
    loads = loads or {}
    views = tuple(WorkerView(Worker(w, f"http://{w}"), True, 1 if loads.get(w) else 0,
                             loads.get(w, 0)) for w in IDS)
    request = RouteRequest(PrefixKey(prompt, prompt[3], 64 * len(prompt)), "m",
                           16 * len(prompt) + 10, 16 * len(prompt))
    engine = build_engine("cache_aware", opts or GUARD)
    return engine.route(request, Snapshot(views, index.at(0.0), RING))


NEW_SESSION = TRUNK + tuple(range(800, 812))  # the trunk + 12 blocks of its own: 4 of 16 known
SECOND = TRUNK + tuple(range(720, 732))  # a second prompt off the trunk
BRANCH_CASES = [
    # The trunk (4 of 16 blocks) is shared: w1 went on past it with another session, and w1
    # has all the recent requests. The session is placed from the ring past the trunk.
    pytest.param(NEW_SESSION, ((OTHER, "w1"),), None, DecisionKind.BRANCH, "",
                 id="branch-off-a-shared-trunk-is-placed-cold"),
    # Half of the prompt or more is the trunk (a shared prompt and a short question): it stays.
    pytest.param((*TRUNK, 900, 901, 902, 903), ((OTHER, "w1"),), None, DecisionKind.PREFIX_HIT,
                 "w1", id="mostly-trunk-stays-with-its-holder"),
    # The known prefix is the end of a prompt (this conversation's own history): no branch,
    # however much the request adds.
    pytest.param(NEW_SESSION, ((TRUNK, "w1"),), None, DecisionKind.PREFIX_HIT, "w1",
                 id="own-history-stays-with-its-holder"),
    # w1 holds the trunk but has no more than its share of the recent requests (the others
    # had as many): the saving wins, the session goes to the trunk's holder.
    pytest.param(NEW_SESSION, ((OTHER, "w1"), ((1,), "w0"), ((2,), "w2"), ((3,), "w3")), None,
                 DecisionKind.PREFIX_HIT, "w1", id="holder-within-its-share-keeps-it"),
    # Switched off.
    pytest.param(NEW_SESSION, ((OTHER, "w1"),), PolicyOptions(branch_guard=0.0),
                 DecisionKind.PREFIX_HIT, "w1", id="branch-guard-0-never-branches"),
    # What went on from the trunk before was extended by later requests (sessions' next
    # turns): a new branch is a session too, placed cold.
    pytest.param(NEW_SESSION, ((OTHER, "w1"), (SECOND, "w1"), ((*SECOND, 740), "w1")), None,
                 DecisionKind.BRANCH, "", id="branches-that-grow-are-placed-cold"),
    # What went on from the trunk was reused from inside (a shared document with new
    # questions), never extended: the trunk and what follows it stay together.
    pytest.param(NEW_SESSION, ((OTHER, "w1"), (SECOND, "w1"), ((*SECOND[:10], 741), "w1")),
                 None, DecisionKind.PREFIX_HIT, "w1", id="branches-reused-stay-with-the-trunk"),
]


@pytest.mark.parametrize(("prompt", "recorded", "opts", "kind", "expected"), BRANCH_CASES)
def test_branches_off_a_shared_trunk(
    prompt: tuple[int, ...],
    recorded: tuple[tuple[tuple[int, ...], str], ...],
    opts: PolicyOptions | None,
    kind: DecisionKind,
    expected: str,
) -> None:
    decision = _branch_route(prompt, recorded, opts)
    assert decision.kind is kind
    if expected:
        assert decision.worker_id == expected
    if kind is DecisionKind.BRANCH:
        assert decision.worker_id != "w1"  # not the holder with all the recent requests
        assert decision.holder == "w1"
        assert decision.holder_blocks == len(TRUNK)
        assert decision.reason.startswith("branch past depth=4 -> ring")


def test_a_branch_is_placed_by_the_ring_past_the_trunk() -> None:
    """Sessions that share the trunk but not what follows start their ring walks at
    different points; a session that shares what follows the trunk starts at the same one."""
    index = PrefixIndex()
    index.record(OTHER, "w1", 0.0)
    ring = Ring({f"x{i}": 1.0 for i in range(32)})
    views = tuple(WorkerView(Worker(f"x{i}", "http://x")) for i in range(32))
    snap = Snapshot(views, index.at(0.0), ring)
    engine = build_engine("cache_aware", PolicyOptions(ring_choices=1, candidate_limit=0))
    index.record(OTHER, "x0", 0.0)

    def route(tail: tuple[int, ...]) -> str:
        prompt = TRUNK + tail
        request = RouteRequest(PrefixKey(prompt, prompt[3], 64 * len(prompt)), "m", 200, 190)
        decision = engine.route(request, snap)
        assert decision.kind is DecisionKind.BRANCH
        first = next(iter(ring.walk(PrefixKey(prompt, prompt[3], 0).anchor_past(4))))
        assert decision.worker_id == first
        return decision.worker_id

    placed = {route(tuple(range(1000 * s, 1000 * s + 12))) for s in range(2, 12)}
    assert len(placed) > 3  # the trunk's anchor alone would send all ten to one worker
    assert route(tuple(range(5000, 5012))) == route((*tuple(range(5000, 5008)), 1, 2, 3, 4))


@pytest.mark.parametrize(("guard", "expected"), [(1.25, "w2"), (0.0, "w1")])
def test_a_trunk_holder_over_its_share_gets_no_credit_for_the_trunk(
    guard: float, expected: str
) -> None:
    """w1 and w2 both hold the trunk; w1 has 3 of the 6 recent requests (over 1.25 x 6 / 4),
    w2 one. w2 has more tokens in flight, so with the trunk credited to both the faint queue
    preference picks w1; without w1's credit, w2's saving of the trunk wins."""
    recorded = ((OTHER, "w1"), (OTHER, "w1"), (OTHER, "w1"), (SECOND, "w2"),
                ((1,), "w0"), ((3,), "w3"))
    decision = _branch_route(NEW_SESSION, recorded, PolicyOptions(branch_guard=guard),
                             loads={"w2": 1000})
    assert decision.kind is DecisionKind.PREFIX_HIT
    assert decision.worker_id == expected


@pytest.mark.parametrize(("waiting", "expected"), [
    pytest.param({}, "w2", id="nobody-waits"),
    pytest.param({"w2": 3}, "w0", id="holder-engine-full-spreads"),
    pytest.param({"w0": 3, "w1": 3, "w2": 3, "w3": 3}, "w2", id="everyone-waits-alike"),
    pytest.param({"w2": 3, "w0": 3}, "w1", id="spreads-where-nobody-waits"),
])
def test_requests_waiting_in_the_holders_engine_move_its_prefix(
    waiting: Mapping[str, int], expected: str
) -> None:
    """The holder's engine has every slot taken by cached requests: no prefill is queued
    anywhere, but requests wait for admission there. Three waiting cost more than the whole
    prefill elsewhere, so the request goes to a worker where none wait (the ring's order
    among equals); when every worker has as many waiting, the holder keeps it."""
    chosen, _ = _route({wid: 100 for wid in IDS}, {"w2": 10}, 400, waiting=waiting)
    assert chosen == expected


# -- the volume guard: one long session cannot make a worker's load ------------------------------
LONG = tuple(range(2000, 2100))  # a long session's history: 100 blocks


# These tests set the volume guard to move a session at once (--no-volume-copy); the default,
# which moves it to a copy of itself, is tested after them.
GUARD = PolicyOptions(volume_guard=1.2, volume_copy=False)


def _volume_route(heavy_turns: int, opts: PolicyOptions | None = None) -> Decision:
    """w1 holds the long session, recorded ``heavy_turns`` times; w0 took the session's first
    20 blocks once, w2 and w3 one 20-block prompt each. The request is the session's next turn
    (it extends the recorded prompt by 4 blocks)."""
    index = PrefixIndex()
    for _ in range(heavy_turns):
        index.record(LONG, "w1", 0.0)
    index.record(LONG[:20], "w0", 0.0)
    for i, wid in enumerate(("w2", "w3")):
        index.record(tuple(range(3000 + 100 * i, 3020 + 100 * i)), wid, 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}")) for w in IDS)
    prompt = (*LONG, 5000, 5001, 5002, 5003)
    request = RouteRequest(PrefixKey(prompt, prompt[3], 64 * len(prompt)), "m",
                           16 * len(prompt) + 10, 16 * len(prompt))
    engine = build_engine("cache_aware", opts or GUARD)
    return engine.route(request, Snapshot(views, index.at(0.0), RING))


@pytest.mark.parametrize(("turns", "opts", "moved"), [
    # 2 turns: w1 has 200 of the pool's 260 recent blocks. Its bound: 1.2 x (260 + 104) / 4
    # = 109.2, plus twice the request (208) = 317.2 >= 200 + 104: it keeps the session.
    pytest.param(2, None, False, id="within-the-slack-the-holder-keeps-it"),
    # 3 turns: 300 of 360; bound 1.2 x 464 / 4 + 208 = 347.2 < 404, and the session routed
    # 424 blocks (w0's 20 and this request included), over half a worker's share (58): it moves.
    pytest.param(3, None, True, id="over-its-share-by-more-than-the-slack-moves"),
    pytest.param(6, PolicyOptions(volume_guard=0.0), False, id="volume-guard-0-never-moves"),
    # With copies (the guard's default when on) a session moves only to a copy of it: until
    # one exists, the holder keeps it. Off by default: never moves.
    pytest.param(6, PolicyOptions(volume_guard=1.2), False,
                 id="with-copies-the-holder-keeps-it-until-a-copy"),
    pytest.param(6, PolicyOptions(), False, id="off-by-default"),
])
def test_a_holder_over_its_share_of_the_recent_volume_loses_the_session(
    turns: int, opts: PolicyOptions | None, moved: bool
) -> None:
    decision = _volume_route(turns, opts)
    if moved:
        # To w0, which holds the session's first 20 blocks and has room for the request:
        # 20 + 104 recent blocks within 1.2 x 116.
        assert decision.worker_id == "w0"
        assert decision.placement == "volume: holder with room"
        assert decision.kind is DecisionKind.DIVERTED
        assert (decision.holder, decision.holder_blocks) == ("w1", 100)
        assert decision.diverted_by == "volume_guard"
        assert decision.reason.startswith("diverted: w1 volume_guard")
    else:
        assert decision.worker_id == "w1"
        assert decision.kind is DecisionKind.PREFIX_HIT


def _session_request(prompt: tuple[int, ...]) -> RouteRequest:
    return RouteRequest(PrefixKey(prompt, prompt[3], 64 * len(prompt)), "m",
                        16 * len(prompt) + 10, 16 * len(prompt))


NEXT_TURN = (*LONG, 5000, 5001, 5002, 5003)  # the long session's next turn: 104 blocks


def _no_room_on_w0(w3_prompts: int) -> PrefixIndex:
    """As in the moved case above (w1 holds the long session, recorded 3 times), but w0,
    which holds the session's first 20 blocks, has three more 20-block prompts recorded; w2
    one 20-block prompt and w3 ``w3_prompts``."""
    index = PrefixIndex()
    for _ in range(3):
        index.record(LONG, "w1", 0.0)
    index.record(LONG[:20], "w0", 0.0)
    for i in range(3):
        index.record(tuple(range(4000 + 100 * i, 4020 + 100 * i)), "w0", 0.0)
    for i in range(1 + w3_prompts):
        index.record(tuple(range(3000 + 100 * i, 3020 + 100 * i)), "w2" if i == 0 else "w3",
                     0.0)
    return index


def test_a_moved_session_goes_where_the_volume_is_least_when_no_holder_has_room() -> None:
    """w0 has 80 + 104 recent blocks against room for 1.2 x 136: the session goes to the
    worker with the least recent volume (w2: 20 blocks, w3: 40), not to w0 for the 20 blocks
    it would save."""
    views = tuple(WorkerView(Worker(w, f"http://{w}")) for w in IDS)
    decision = build_engine("cache_aware", GUARD).route(
        _session_request(NEXT_TURN), Snapshot(views, _no_room_on_w0(2).at(0.0), RING))
    assert decision.worker_id == "w2"
    assert decision.placement == "volume: least recent volume"
    assert decision.kind is DecisionKind.DIVERTED
    assert (decision.holder, decision.diverted_by) == ("w1", "volume_guard")


def test_workers_equal_for_a_moved_session_resolve_in_ring_order() -> None:
    """As above with w2 and w3 at the same recent volume: the session goes to the first of
    them on the ring from its anchor, whatever order the pool lists its workers in (gateway
    replicas and the simulator must choose alike)."""
    index = _no_room_on_w0(1)
    first = next(wid for wid in RING.walk(NEXT_TURN[3]) if wid in ("w2", "w3"))
    views = [WorkerView(Worker(w, f"http://{w}")) for w in IDS]
    engine = build_engine("cache_aware", GUARD)
    chosen = {engine.route(_session_request(NEXT_TURN),
                           Snapshot(tuple(order), index.at(0.0), RING)).worker_id
              for order in (views, views[::-1])}
    assert chosen == {first}


SESSIONS_TRUNK = tuple(range(7000, 7020))  # a prefix sessions share: 20 blocks


@pytest.mark.parametrize("trunk_elsewhere", [True, False])
def test_a_medium_session_moves_only_where_a_holder_of_its_trunk_has_room(
    trunk_elsewhere: bool
) -> None:
    """w1 holds a session (the trunk and 10 blocks of its own, routed once) and six other
    sessions of 60 blocks off the same trunk: 390 recent blocks, over its bound of
    1.2 x 203 + 64 = 307.6 with the session's next turn (32 blocks). The session routed
    30 + 32 blocks, between a fifth and half of a worker's share (40.6 and 101.5). When w0
    holds the trunk with room for the turn (30 + 32 within 1.2 x 203), the session moves
    there, redoing only its own 10 blocks; with no other holder it stays."""
    index = PrefixIndex()
    session = (*SESSIONS_TRUNK, *range(7100, 7110))
    index.record(session, "w1", 0.0)
    for i in range(6):
        index.record((*SESSIONS_TRUNK, *range(7200 + 100 * i, 7240 + 100 * i)), "w1", 0.0)
    if trunk_elsewhere:
        index.record((*SESSIONS_TRUNK, *range(7900, 7910)), "w0", 0.0)
    else:
        index.record(tuple(range(8900, 8930)), "w0", 0.0)
    for i, wid in enumerate(("w2", "w2", "w2", "w3", "w3", "w3")):
        index.record(tuple(range(9000 + 100 * i, 9060 + 100 * i)), wid, 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}")) for w in IDS)
    request = _session_request((*session, 7110, 7111))
    snapshot = Snapshot(views, index.at(0.0), RING)
    decision = build_engine("cache_aware", GUARD).route(request, snapshot)
    if trunk_elsewhere:
        assert decision.worker_id == "w0"
        assert decision.kind is DecisionKind.DIVERTED
        assert decision.diverted_by == "volume_guard"
    else:
        assert decision.worker_id == "w1"
        assert decision.kind is DecisionKind.PREFIX_HIT


# With ``volume_copy`` (its default) a session over the guard moves only to a worker that
# holds a copy of it: until one does, its holder keeps it and the decision names where to copy
# it. The guard at the setting it was tuned at (off by default).
COPY = PolicyOptions(volume_guard=1.1)


def test_a_session_over_the_guard_stays_and_is_copied() -> None:
    """The moved case above (w1 over its bound with the session; w0, w2 and w3 each with 20
    recent blocks, none prefilling) with copies: the request stays on w1, a prefix hit of
    all 100 blocks, and the decision names the first of the three on the ring from the
    request's anchor to copy it to."""
    decision = _volume_route(3, COPY)
    assert decision.worker_id == "w1"
    assert decision.kind is DecisionKind.PREFIX_HIT
    assert decision.match_blocks == 100
    first = next(w for w in RING.walk(NEXT_TURN[3]) if w != "w1")
    assert decision.copy_to == first
    assert decision.reason == f"prefix_hit depth=100 (session copied to {first})"
    # Within the slack nothing is copied.
    assert _volume_route(2, COPY).copy_to == ""


def _copy_to(others: tuple[str, ...], busy: tuple[str, ...]) -> str:
    """Where the session w1 holds (over the guard: 3 turns) is copied, with ``others``
    listing the holder of each other 20-block prompt recorded (their recent volume) and
    ``busy`` the workers prefilling 500 tokens."""
    index = PrefixIndex()
    for _ in range(3):
        index.record(LONG, "w1", 0.0)
    for i, wid in enumerate(others):
        index.record(tuple(range(3000 + 100 * i, 3020 + 100 * i)), wid, 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}"), inflight_prefill=500 * (w in busy))
                  for w in IDS)
    decision = build_engine("cache_aware", COPY).route(
        _session_request(NEXT_TURN), Snapshot(views, index.at(0.0), RING))
    assert decision.worker_id == "w1"
    return decision.copy_to


@pytest.mark.parametrize("busy", [("w2",), ("w0", "w2", "w3")])
def test_a_copy_goes_only_where_no_prefill_is_queued(busy: tuple[str, ...]) -> None:
    """w2 has the least recent volume but is prefilling a prompt; w0 and w3, with more
    volume, are not: the copy (a whole history's prefill) goes to the lighter of those two,
    not beside w2's prefill. With every other worker prefilling, nothing is copied now."""
    copy_to = _copy_to(("w0", "w0", "w2", "w3", "w3", "w3"), busy)
    assert copy_to == ("w0" if len(busy) == 1 else "")


@pytest.mark.parametrize(("busy", "expected"), [((), "w0"), (("w3",), "w0"),
                                                 (("w2", "w3"), "")])
def test_a_copy_is_made_only_while_the_pool_has_capacity_to_spare(
    busy: tuple[str, ...], expected: str
) -> None:
    """w0 is idle and has the least recent volume of the idle workers, but a copy is made
    only while at most a quarter of the pool is prefilling (one worker of four here): with
    two of four busy, an idle worker would not stay idle for the length of a whole
    history's prefill, and the session stays whole for now."""
    assert _copy_to(("w0", "w2", "w2", "w3", "w3", "w3"), busy) == expected


def test_a_worker_making_a_copy_gets_no_other() -> None:
    """As above, with w0 (where the copy would go) already making a copy of another session:
    the copy goes to the next choice, the worker with the least recent volume."""
    index = PrefixIndex()
    for _ in range(3):
        index.record(LONG, "w1", 0.0)
    index.record(LONG[:20], "w0", 0.0)
    for i, wid in enumerate(("w2", "w3", "w3")):
        index.record(tuple(range(3000 + 100 * i, 3020 + 100 * i)), wid, 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}"), copies=int(w == "w0")) for w in IDS)
    decision = build_engine("cache_aware", COPY).route(
        _session_request(NEXT_TURN), Snapshot(views, index.at(0.0), RING))
    assert (decision.worker_id, decision.copy_to) == ("w1", "w2")


def test_a_worker_that_runs_copies_at_background_priority_takes_one_however_busy() -> None:
    """Every worker but the holder is prefilling and w2 (the least recent volume) is making
    another copy as well: where engines run copies at a background priority
    (``copies_yield``) the copy goes to w2 anyway, since it takes only the capacity the
    requests there leave; where they do not, nothing is copied now."""
    index = PrefixIndex()
    for _ in range(3):
        index.record(LONG, "w1", 0.0)
    for i, wid in enumerate(("w0", "w0", "w2", "w3", "w3", "w3")):
        index.record(tuple(range(3000 + 100 * i, 3020 + 100 * i)), wid, 0.0)

    def copy_to(yields: bool) -> str:
        views = tuple(WorkerView(Worker(w, f"http://{w}"), inflight_prefill=500 * (w != "w1"),
                                 copies=int(w == "w2"), copies_yield=yields) for w in IDS)
        decision = build_engine("cache_aware", COPY).route(
            _session_request(NEXT_TURN), Snapshot(views, index.at(0.0), RING))
        assert decision.worker_id == "w1"
        return decision.copy_to

    assert copy_to(yields=True) == "w2"
    assert copy_to(yields=False) == ""


def _copied(busy: bool, inflight: Mapping[str, int] | None = None,
            w1_extra: int = 0, copied: int = 100, yields: bool = False,
            prefilling: tuple[str, ...] = (), opts: PolicyOptions = COPY) -> Decision:
    """w1 holds the long session (3 turns) and three other 100-block prompts: 600 recent
    blocks; w2 holds a copy of the session (100 blocks) and, when ``busy``, six other
    100-block prompts. Idle, w2 is within its bound with the next turn (204 against
    1.2 x 276 + 208); busy, it is over it like w1 (804 against 1.2 x 426 + 208).
    ``w1_extra`` more 100-block prompts on w1; ``inflight``: tokens in flight per worker;
    ``copied``: the session's first blocks the copy on w2 holds; ``yields``: the engines
    run copies at background priority; ``prefilling``: workers with 500 tokens of prefill
    queued."""
    index = PrefixIndex()
    for _ in range(3):
        index.record(LONG, "w1", 0.0)
    for i in range(3 + w1_extra):
        index.record(tuple(range(10000 + 100 * i, 10100 + 100 * i)), "w1", 0.0)
    index.record(LONG[:copied], "w2", 0.0)
    for i in range(6 if busy else 0):
        index.record(tuple(range(20000 + 100 * i, 20100 + 100 * i)), "w2", 0.0)
    loads = inflight or {}
    views = tuple(WorkerView(Worker(w, f"http://{w}"), True, 1 if loads.get(w) else 0,
                             loads.get(w, 0), inflight_prefill=500 * (w in prefilling),
                             copies_yield=yields) for w in IDS)
    engine = build_engine("cache_aware", opts)
    return engine.route(_session_request(NEXT_TURN), Snapshot(views, index.at(0.0), RING))


def test_a_session_over_the_guard_moves_to_its_copy() -> None:
    """Once w2 holds a copy of the whole session and is within its own bound, the next turn
    goes there: a prefix hit of all 100 blocks, nothing redone, and nothing copied again."""
    decision = _copied(busy=False)
    assert decision.worker_id == "w2"
    assert decision.kind is DecisionKind.PREFIX_HIT
    assert decision.match_blocks == 100
    assert decision.copy_to == ""


@pytest.mark.parametrize("why", ["background-priority", "no-refresh", "copy-worker-busy"])
def test_a_session_moves_to_a_copy_that_lacks_its_last_turn(why: str) -> None:
    """w2's copy holds the first 80 of the 100 blocks w1 holds (three quarters or more). It
    takes the session, which redoes the last 20 there (diverted by the volume guard), where
    the engines run copies at background priority (a copy counts once it answered, by when
    the holder has had the session's next turn: it always lacks one), where copies are not
    brought up to date (``volume_refresh`` off), and where w2 cannot take a copy now (a
    prefill queued there). A copy of 60 does not take it, and the holder keeps it."""
    cases: dict[str, dict[str, Any]] = {
        "background-priority": {"yields": True},
        "no-refresh": {"opts": PolicyOptions(volume_guard=1.1, volume_refresh=False)},
        "copy-worker-busy": {"prefilling": ("w2",)},
    }
    args = cases[why]
    moved = _copied(busy=False, copied=80, **args)
    assert moved.worker_id == "w2"
    assert moved.kind is DecisionKind.DIVERTED
    assert moved.diverted_by == "volume_guard"
    assert moved.match_blocks == 80
    assert moved.placement == "volume: its copy"
    assert moved.copy_to == ""
    kept = _copied(busy=False, copied=60, **args)
    assert kept.worker_id == "w1"
    assert kept.match_blocks == 100


def test_a_copy_that_lacks_turns_is_brought_up_to_date_before_the_session_moves() -> None:
    """With the copy recorded when it was sent (an engine that runs it as any request) and
    w2 free to take one, w2's copy of 80 of the 100 blocks is copied again instead: the
    holder keeps this turn (a prefix hit of all 100) and the copy goes to w2, where only the
    last 20 blocks are computed. The next turn finds the copy whole and moves there, a
    prefix hit with nothing redone (test above: the session moves to its copy)."""
    decision = _copied(busy=False, copied=80)
    assert decision.worker_id == "w1"
    assert decision.kind is DecisionKind.PREFIX_HIT
    assert decision.match_blocks == 100
    assert decision.copy_to == "w2"


@pytest.mark.parametrize("refresh", [True, False])
def test_a_whole_copy_with_room_takes_the_session_from_a_holder_within_the_slack(
    refresh: bool
) -> None:
    """w1 holds the session (100 blocks) and another 100-block prompt: 304 recent blocks with
    the next turn, over its bound (1.1 x 1,004 / 4 = 276) but within the slack (+ 208), which
    keeps a session whose move would redo part of it. w2 holds all of it too (its copy,
    recorded at its send) with room (204). A move there redoes nothing, so the session goes
    to w2 although w1 is not past the slack, and although w2 has a request in flight that
    would make the queue-based cost keep it on w1. Without refreshes (a copy counted at three
    quarters of the holder's part) w1 keeps it within the slack."""
    index = PrefixIndex()
    index.record(LONG, "w1", 0.0)
    index.record(tuple(range(10000, 10100)), "w1", 0.0)
    index.record(LONG, "w2", 0.0)
    for i in range(6):
        index.record(tuple(range(20000 + 100 * i, 20100 + 100 * i)), "w0" if i < 3 else "w3",
                     0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}"), True, int(w == "w2"),
                             500 * (w == "w2")) for w in IDS)
    opts = PolicyOptions(volume_guard=1.1, volume_refresh=refresh)
    decision = build_engine("cache_aware", opts).route(
        _session_request(NEXT_TURN), Snapshot(views, index.at(0.0), RING))
    assert decision.match_blocks == 100
    assert decision.copy_to == ""
    if refresh:
        assert decision.worker_id == "w2"
        assert decision.kind is DecisionKind.PREFIX_HIT
    else:
        assert decision.worker_id == "w1"


def test_a_copy_on_a_worker_over_its_own_bound_does_not_take_the_session() -> None:
    """w2's copy does not take the session where w2 is over its own bound too (804 recent
    blocks against w1's 704): the holder keeps it, and it is copied to a worker that holds
    none of it. Both hold the whole prompt, so the queue-based cost alone would send it to
    whichever had less in flight: w2 here, the heavier."""
    decision = _copied(busy=True, inflight={"w1": 2000})
    assert decision.worker_id == "w1"
    assert decision.kind is DecisionKind.PREFIX_HIT
    assert decision.copy_to in ("w0", "w3")


def test_of_two_holders_over_their_bound_the_lighter_keeps_the_session() -> None:
    """The same with w1 the heavier (three more 100-block prompts there): w2, which holds
    the whole session too, keeps it, wherever less is in flight."""
    decision = _copied(busy=True, inflight={"w2": 2000}, w1_extra=3)
    assert decision.worker_id == "w2"
    assert decision.copy_to in ("w0", "w3")


def test_the_volume_guard_must_be_off_or_at_least_1() -> None:
    with pytest.raises(ValueError, match="volume_guard"):
        PolicyOptions(volume_guard=0.5)


def test_the_volume_guard_leaves_a_shared_prompt_with_its_holder() -> None:
    """Requests that share a prompt from inside (a system prompt, a document) are not a
    session: copying the prompt does not move any load, so the guard does not apply. w1 took
    every recent request, each the shared 100 blocks and a question of its own."""
    index = PrefixIndex()
    for q in range(6):
        index.record((*LONG, 6000 + q), "w1", 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}")) for w in IDS)
    prompt = (*LONG, 7000)
    request = RouteRequest(PrefixKey(prompt, prompt[3], 64 * len(prompt)), "m",
                           16 * len(prompt) + 10, 16 * len(prompt))
    snapshot = Snapshot(views, index.at(0.0), RING)
    decision = build_engine("cache_aware", GUARD).route(request, snapshot)
    assert decision.worker_id == "w1"
    assert decision.kind is DecisionKind.PREFIX_HIT


def test_the_volume_guard_leaves_a_light_session_with_its_holder() -> None:
    """w1 is over its bound because of eight other sessions, not this one: a 10-block session
    routed once. Moving it would cost its prefill for a tenth of the excess; placing new
    sessions elsewhere balances such load, so it stays."""
    index = PrefixIndex()
    session = tuple(range(9000, 9010))
    index.record(session, "w1", 0.0)
    for i in range(8):
        index.record(tuple(range(8000 + 100 * i, 8030 + 100 * i)), "w1", 0.0)
    for i, wid in enumerate(("w0", "w2", "w3")):
        index.record(tuple(range(3000 + 100 * i, 3020 + 100 * i)), wid, 0.0)
    views = tuple(WorkerView(Worker(w, f"http://{w}")) for w in IDS)
    prompt = (*session, 9100, 9101)
    request = RouteRequest(PrefixKey(prompt, prompt[3], 64 * len(prompt)), "m",
                           16 * len(prompt) + 10, 16 * len(prompt))
    # w1: 250 + 12 recent blocks against 1.2 x 322 / 4 + 24 = 120.6: over; but the session
    # routed 10 + 12 blocks, under half a worker's share (40.25).
    snapshot = Snapshot(views, index.at(0.0), RING)
    decision = build_engine("cache_aware", GUARD).route(request, snapshot)
    assert decision.worker_id == "w1"
    assert decision.kind is DecisionKind.PREFIX_HIT


def test_a_decision_names_the_deepest_prefix_any_worker_holds() -> None:
    """Below the policy's minimum match a holder gets no credit, but telemetry still learns
    how much of the prompt was known somewhere (what a miss is measured against)."""
    index = PrefixIndex()
    index.record(BLOCKS[:1], "w3", 0.0)
    views = tuple(WorkerView(Worker(wid, f"http://{wid}")) for wid in IDS)
    request = RouteRequest(PrefixKey(BLOCKS, ANCHOR, 640), "m", 410, 400)
    engine = build_engine("cache_aware", PolicyOptions())
    cold = engine.route(request, Snapshot(views, index.at(0.0), RING))
    assert (cold.kind, cold.match_blocks, cold.known_blocks) == (DecisionKind.COLD, 0, 1)
    index.record(BLOCKS[:6], "w2", 0.0)
    hit = engine.route(request, Snapshot(views, index.at(0.0), RING))
    assert (hit.worker_id, hit.match_blocks, hit.known_blocks) == ("w2", 6, 6)
