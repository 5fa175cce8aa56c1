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
