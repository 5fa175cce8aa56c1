"""cache_aware's cold placement (SpreadPicker): recent requests, cache turnover, in-flight guard.

Two workers on a two-worker ring, no holder of the request's prefix (cold), so the choice is
the picker's alone; every expectation says which term decides it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from gateway.fingerprint import PrefixKey
from gateway.routing.policies import PolicyOptions, build_engine
from gateway.routing.policies.spread_picker import SpreadPicker
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import RouteRequest, Snapshot, Worker, WorkerView

IDS = ("w0", "w1")
RING = Ring({wid: 1.0 for wid in IDS})
ANCHOR = next(a for a in range(1_000_000) if tuple(RING.walk(a)) == IDS)  # w0 first
OPTS = PolicyOptions(ring_choices=2)


def _cold_request(blocks: int) -> RouteRequest:
    key = PrefixKey(tuple(range(10_000, 10_000 + blocks)), ANCHOR, blocks * 64)
    return RouteRequest(key, "m", blocks * 16 + 10, blocks * 16)


def _route(
    index: PrefixIndex,
    blocks: int,
    inflight: Mapping[str, int] | None = None,
    opts: PolicyOptions = OPTS,
    now: float = 3.0,
) -> str:
    inflight = inflight or {}
    views = tuple(
        WorkerView(Worker(wid, f"http://{wid}"), True, inflight.get(wid, 0),
                   100 * inflight.get(wid, 0))
        for wid in IDS
    )
    decision = build_engine("cache_aware", opts).route(
        _cold_request(blocks), Snapshot(views, index.at(now), RING)
    )
    assert decision.match_blocks == 0
    return decision.worker_id


def _fill(index: PrefixIndex, wid: str, first: int, count: int, times: Sequence[float]) -> None:
    """``len(times)`` one-block-per-step requests for ``wid``, block ids from ``first``."""
    for i, t in enumerate(times):
        index.record(list(range(first + i * count, first + (i + 1) * count)), wid, t)


def test_fresh_index_goes_by_load_then_ring_order() -> None:
    index = PrefixIndex()
    assert _route(index, 4) == "w0"
    assert _route(index, 4, {"w0": 1}) == "w1"


def test_recent_requests_balance_the_placement() -> None:
    index = PrefixIndex()
    _fill(index, "w0", 0, 2, [1.0, 2.0, 3.0])  # three recent requests on w0
    _fill(index, "w1", 1000, 2, [3.0])  # one on w1, whose cache is also the emptier
    assert _route(index, 4) == "w1"


def test_old_requests_weigh_less_than_new_ones() -> None:
    index = PrefixIndex(heat_half_life_s=10.0)
    _fill(index, "w0", 0, 2, [0.0, 0.0, 0.0])  # three, long ago
    _fill(index, "w1", 1000, 6, [99.0])  # one, just now (and as many blocks: equal fill)
    assert _route(index, 4, now=100.0) == "w0"


def _filling() -> PrefixIndex:
    """No cache full: w0 took one long prompt (40 of 200 blocks), w1 two short ones (4)."""
    index = PrefixIndex(heat_half_life_s=1000.0)
    for wid in IDS:
        index.set_capacity(wid, 200)
    _fill(index, "w0", 0, 40, [1.0])
    _fill(index, "w1", 1000, 2, [1.0, 2.0])
    return index


@pytest.mark.parametrize(("blocks", "expected"), [(1, "w0"), (100, "w1")])
def test_while_caches_fill_a_long_prompt_goes_to_the_emptier_cache(
    blocks: int, expected: str
) -> None:
    # No cache evicts yet, so the pressure is the fill: 0.2 against 0.02 (1.82 / 0.18 of the
    # mean). Requests 1 against 2 (0.67 / 1.33); mean size 44 / 3 blocks.
    # 1 block:   w0 0.67 + 4 * 0.068 * 1.82 = 1.16,  w1 1.33 + 4 * 0.068 * 0.18 = 1.38 -> w0
    # 100 blocks: w0 0.67 + 4 * 6.8 * 1.82 = 50,     w1 1.33 + 4 * 6.8 * 0.18 = 6.3  -> w1
    assert _route(_filling(), blocks) == expected


def _two_kinds_of_load() -> PrefixIndex:
    """w0: more recent requests, but its cache turns over slowly; w1: the opposite."""
    index = PrefixIndex(heat_half_life_s=1000.0)  # counts barely decay within the test
    for wid in IDS:
        index.set_capacity(wid, 200)
    _fill(index, "w0", 0, 50, [10.0] * 4)  # 4 requests, full; oldest block 90 s old at t=100
    _fill(index, "w1", 1000, 100, [55.0] * 2)  # 2 requests, full; oldest block 45 s old
    return index  # read at t = 100


@pytest.mark.parametrize(("blocks", "expected"), [(1, "w1"), (150, "w0")])
def test_a_long_prompt_goes_where_eviction_is_cheapest_a_short_one_where_requests_are_fewest(
    blocks: int, expected: str
) -> None:
    # key = recent / mean + 4 * (size / mean size) * pressure / mean, mean size 400 / 6 blocks:
    # requests 4 vs 2 (1.33 vs 0.67 of the mean), turnover 1/90 vs 1/45 (0.67 vs 1.33).
    # 1 block:   w0 1.33 + 4 * 0.015 * 0.67 = 1.37,  w1 0.67 + 4 * 0.015 * 1.33 = 0.75 -> w1
    # 150 blocks: w0 1.33 + 4 * 2.25 * 0.67 = 7.33,  w1 0.67 + 4 * 2.25 * 1.33 = 12.7 -> w0
    assert _route(_two_kinds_of_load(), blocks, now=100.0) == expected


def test_pressure_weight_zero_balances_requests_only() -> None:
    opts = PolicyOptions(ring_choices=2, pressure_weight=0.0)
    assert _route(_two_kinds_of_load(), 150, opts=opts, now=100.0) == "w1"


def test_a_choice_far_over_the_mean_in_flight_is_skipped() -> None:
    index = PrefixIndex()
    _fill(index, "w1", 1000, 2, [1.0, 2.0, 3.0])  # w1 looks busier by recent requests
    # ...but w0 has 4 requests in flight against w1's 1: over 1.5 x their mean of 2.5.
    assert _route(index, 4, {"w0": 4, "w1": 1}) == "w1"
    # With the guard wide open the recent requests decide: w0.
    wide = PolicyOptions(ring_choices=2, spread_guard=10.0)
    assert _route(index, 4, {"w0": 4, "w1": 1}, opts=wide) == "w0"


@pytest.mark.parametrize(("guard", "weight"), [(0.5, 1.0), (1.5, -1.0)])
def test_bad_options_are_refused(guard: float, weight: float) -> None:
    with pytest.raises(ValueError, match="must be >="):
        SpreadPicker(2, guard, weight)
