"""The cache_aware policy: one cost (prefill it cannot skip + queue) under the hard bound."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from gateway.fingerprint import PrefixKey
from gateway.routing.policies import PolicyOptions, build_engine
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import RouteRequest, Snapshot, Worker, WorkerView

IDS = ("w0", "w1", "w2", "w3")
RING = Ring({wid: 1.0 for wid in IDS})
ANCHOR = next(a for a in range(1_000_000) if tuple(RING.walk(a)) == IDS)
BLOCKS = tuple(range(500, 510))  # 10 blocks


def _route(
    loads: Mapping[str, int],
    held: Mapping[str, int],
    prompt_tokens: int,
    opts: PolicyOptions | None = None,
) -> tuple[str, str]:
    index = PrefixIndex()
    for wid, depth in held.items():
        index.record(BLOCKS[:depth], wid, 0.0)
    views = tuple(
        WorkerView(Worker(wid, f"http://{wid}"), True, 1 if loads.get(wid) else 0,
                   loads.get(wid, 0))
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
    # Total 1,500 in flight; w2's guard is 3 x 1/4 x (1,500 + 50) = 1,162 < 1,200.
    chosen, why = _route({"w2": 1200, "w0": 100, "w1": 100, "w3": 100}, {"w2": 10}, 40)
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
# cost = prefill * (1 + evict if full) * (1 + sum Q / P) + max(0, Q - mean Q)   (T = 0 here)
SPREAD_CASES = [
    # Nobody queues: the holder wins, however many requests shared the prefix before.
    pytest.param({}, 400, "w2", id="idle-pool-stays-on-holder"),
    # Holder 1600 queued, the others 0: mean 400. Holder: 0 + 1200. Others: 400 x (1 + 4)
    # = 2000: the holder still wins, a move adds more work than it saves.
    pytest.param({"w2": 1600}, 400, "w2", id="moderate-queue-stays"),
    # Holder 8000: mean 2000. Holder: 6000. Others: 400 x 21 = 8400: the busier the pool,
    # the dearer every miss.
    pytest.param({"w2": 8000}, 400, "w2", id="busy-pool-miss-is-dear"),
    # A short prompt (40): others 40 x (1 + 200) = 8040 against the holder's 6000.
    pytest.param({"w2": 8000}, 40, "w2", id="short-prompt-stays"),
]


@pytest.mark.parametrize(("prefill", "prompt", "expected"), SPREAD_CASES)
def test_a_whole_prefix_stays_on_its_holder_unless_waiting_costs_more(
    prefill: Mapping[str, int], prompt: int, expected: str
) -> None:
    chosen, why = _spread(prefill, {"w2": 10}, prompt)
    assert (chosen, why) == (expected, "prefix_hit depth=10")


def test_a_partial_holder_spreads_when_its_queue_costs_more_than_the_prefill() -> None:
    # w2 holds 2 of 10 blocks (saves 20% of P = 1000). Queues: w2 9000, the others 0;
    # mean 2250. w2: 800 x (1 + 9) + 6750 = 14750; an idle worker: 1000 x 10 = 10000.
    chosen, why = _spread({"w2": 9000}, {"w2": 2}, 1000)
    assert chosen != "w2"
    assert why.startswith("spread: w2 outscored (depth=2)")
    # With w2's queue at the mean (all four at 2250) it keeps its prefix.
    even = dict.fromkeys(IDS, 2250)
    assert _spread(even, {"w2": 2}, 1000) == ("w2", "prefix_hit depth=2")


def test_a_full_cache_makes_a_move_dearer() -> None:
    # w2 holds 5 of 10 blocks; queues w2 5000, others 0; mean 1250, P = 1000 (x 6).
    # Room everywhere: w2 500 x 6 + 3750 = 6750 > an idle worker's 1000 x 6 = 6000: moves.
    # Full caches: w2 500 x 2 x 6 + 3750 = 9750 < 1000 x 2 x 6 = 12000: stays.
    assert _spread({"w2": 5000}, {"w2": 5}, 1000)[0] != "w2"
    assert _spread({"w2": 5000}, {"w2": 5}, 1000, full=True)[0] == "w2"


def test_the_policy_weights_are_validated() -> None:
    with pytest.raises(ValueError, match="weights"):
        build_engine("cache_aware", PolicyOptions(wait_weight=-1.0))
    with pytest.raises(ValueError, match="candidate_limit"):
        PolicyOptions(candidate_limit=-1)
