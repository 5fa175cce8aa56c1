"""Table-driven tests of every routing policy over in-memory workers (llm-d style).

Each case builds a :class:`Snapshot` from plain :class:`WorkerView` values, a real
:class:`PrefixIndex` and a real :class:`Ring`, routes one request with the engine from
``build_engine(name)`` and checks the chosen worker, the reason and the load bound.

The request anchor is chosen once so that the ring walk over ``w0..w3`` is exactly
``w0, w1, w2, w3``: the tables can then name the ring owner and its successors literally.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from gateway.fingerprint import PrefixKey
from gateway.routing.policies import POLICY_NAMES, PolicyOptions, build_engine
from gateway.routing.policies.bounded_load import BoundedLoadFilter, load_bound
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import (
    Decision,
    NoCandidates,
    RouteRequest,
    Snapshot,
    Worker,
    WorkerView,
)

IDS = ("w0", "w1", "w2", "w3")
RING4 = Ring({wid: 1.0 for wid in IDS})
ANCHOR = next(a for a in range(1_000_000) if tuple(RING4.walk(a)) == IDS)
BLOCKS = tuple(range(1001, 1009))  # the request's 8 chained block hashes
MODEL = "m"
C = PolicyOptions().load_factor  # 1.25


def _key(blocks: tuple[int, ...] = BLOCKS, anchor: int = ANCHOR) -> PrefixKey:
    return PrefixKey(blocks=blocks, anchor=anchor, text_chars=64 * len(blocks))


def _views(
    loads: Mapping[str, int] | None = None,
    unhealthy: frozenset[str] = frozenset(),
    models: Mapping[str, frozenset[str]] | None = None,
) -> tuple[WorkerView, ...]:
    loads = loads or {}
    models = models or {}
    return tuple(
        WorkerView(
            Worker(wid, f"http://{wid}:8000", models.get(wid, frozenset())),
            healthy=wid not in unhealthy,
            inflight_requests=1 if loads.get(wid, 0) else 0,
            inflight_tokens=loads.get(wid, 0),
        )
        for wid in IDS
    )


def _snapshot(views: tuple[WorkerView, ...], held: Mapping[str, int] | None = None) -> Snapshot:
    index = PrefixIndex()
    for wid, depth in (held or {}).items():
        index.record(BLOCKS[:depth], wid, 0.0)
    ring = Ring({v.id: v.worker.weight for v in views})
    return Snapshot(workers=views, index=index.at(0.0), ring=ring)


def test_anchor_fixture_walk() -> None:
    assert tuple(RING4.walk(ANCHOR)) == IDS


@dataclass(frozen=True)
class Case:
    id: str
    policy: str
    expect: str
    reason: str  # the reason must start with this
    loads: Mapping[str, int] = field(default_factory=dict)
    unhealthy: frozenset[str] = frozenset()
    models: Mapping[str, frozenset[str]] = field(default_factory=dict)
    held: Mapping[str, int] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()
    cost: int = 100
    model: str = MODEL
    match_blocks: int = 0
    exact_reason: bool = False


OTHER = frozenset({"other-model"})

CASES = [
    # -- consistent_hash: the ring owner of the anchor, skipping filtered workers ------------
    Case("ch-owner", "consistent_hash", "w0", "ring", exact_reason=True),
    Case("ch-owner-even-if-loaded", "consistent_hash", "w0", "ring", loads={"w0": 10_000}),
    Case("ch-skips-unhealthy-owner", "consistent_hash", "w1", "ring skip=1",
         unhealthy=frozenset({"w0"}), exact_reason=True),
    Case("ch-skips-two", "consistent_hash", "w2", "ring skip=2",
         unhealthy=frozenset({"w0", "w1"}), exact_reason=True),
    Case("ch-exclude-owner", "consistent_hash", "w1", "ring skip=1", exclude=frozenset({"w0"})),
    Case("ch-model-filter", "consistent_hash", "w2", "ring skip=2",
         models={"w0": OTHER, "w1": OTHER, "w2": frozenset({MODEL})}),
    Case("ch-ignores-prefix", "consistent_hash", "w0", "ring", held={"w3": 8}),
    # -- least_load: fewest in-flight tokens, ties by ring order ----------------------------
    Case("ll-fewest-tokens", "least_load", "w1", "ring",
         loads={"w0": 500, "w1": 100, "w2": 300, "w3": 200}),
    Case("ll-idle-tie-goes-to-ring-owner", "least_load", "w0", "ring", exact_reason=True),
    Case("ll-tie-among-lightest", "least_load", "w2", "ring skip=2",
         loads={"w0": 9, "w1": 9, "w2": 1, "w3": 1}, exact_reason=True),
    Case("ll-ignores-unhealthy-idle", "least_load", "w2", "ring",
         loads={"w0": 500, "w1": 0, "w2": 50, "w3": 400}, unhealthy=frozenset({"w1"})),
    Case("ll-exclude", "least_load", "w3", "ring",
         loads={"w0": 500, "w1": 100, "w2": 300, "w3": 200}, exclude=frozenset({"w1"})),
    # -- bounded_hash: ring walk, skipping workers over c * share * (L + r) ------------------
    # L = 1000, r = 100: bound = 1.25 * 0.25 * 1100 = 343.75
    Case("bh-owner-over-bound", "bounded_hash", "w1", "ring skip=1",
         loads={"w0": 1000}, exact_reason=True),
    Case("bh-owner-under-bound", "bounded_hash", "w0", "ring",
         loads={"w0": 300, "w1": 300, "w2": 300, "w3": 100}, exact_reason=True),
    # L = 1500, r = 100: bound = 500 exactly
    Case("bh-owner-at-bound-kept", "bounded_hash", "w0", "ring",
         loads={"w0": 500, "w1": 500, "w2": 500}),
    Case("bh-owner-just-over-bound", "bounded_hash", "w1", "ring skip=1",
         loads={"w0": 501, "w1": 500, "w2": 499}),
    Case("bh-two-over-bound", "bounded_hash", "w2", "ring skip=2",
         loads={"w0": 1000, "w1": 1000}),
    Case("bh-unhealthy-owner", "bounded_hash", "w1", "ring skip=1",
         unhealthy=frozenset({"w0"})),
    Case("bh-idle-owner", "bounded_hash", "w0", "ring"),
    # -- prefix_affinity ---------------------------------------------------------------------
    Case("pa-deepest-holder", "prefix_affinity", "w2", "prefix_hit depth=5",
         held={"w2": 5, "w3": 2}, match_blocks=5, exact_reason=True),
    Case("pa-full-match", "prefix_affinity", "w3", "prefix_hit depth=8",
         held={"w1": 7, "w3": 8}, match_blocks=8, exact_reason=True),
    Case("pa-equal-holders-ring-order", "prefix_affinity", "w1", "prefix_hit depth=4",
         held={"w3": 4, "w1": 4}, match_blocks=4, exact_reason=True),
    Case("pa-cold-to-ring", "prefix_affinity", "w0", "cold -> ring", exact_reason=True),
    Case("pa-cold-owner-over-bound", "prefix_affinity", "w1", "cold -> ring skip=1",
         loads={"w0": 1000}, exact_reason=True),
    Case("pa-holder-over-bound-diverted", "prefix_affinity", "w0",
         "diverted: w2 bounded_load (depth=8) -> ring", held={"w2": 8}, loads={"w2": 1000},
         exact_reason=True),
    Case("pa-holder-over-bound-next-holder", "prefix_affinity", "w3", "prefix_hit depth=3",
         held={"w2": 8, "w3": 3}, loads={"w2": 1000}, match_blocks=3, exact_reason=True),
    Case("pa-holder-unhealthy-diverted", "prefix_affinity", "w0", "diverted: w2 healthy",
         held={"w2": 8}, unhealthy=frozenset({"w2"})),
    Case("pa-holder-wrong-model-diverted", "prefix_affinity", "w0", "diverted: w2 model",
         held={"w2": 8}, models={"w2": OTHER}),
    Case("pa-holder-excluded-diverted", "prefix_affinity", "w0", "diverted: w2",
         held={"w2": 8}, exclude=frozenset({"w2"})),
    Case("pa-holder-under-bound-kept", "prefix_affinity", "w2", "prefix_hit depth=6",
         held={"w2": 6}, loads={"w2": 300, "w0": 300, "w1": 300, "w3": 100}, match_blocks=6),
    # -- round_robin, first pick ------------------------------------------------------------
    Case("rr-first", "round_robin", "w0", "round_robin", exact_reason=True),
    Case("rr-first-healthy", "round_robin", "w1", "round_robin", unhealthy=frozenset({"w0"})),
]


def _route(case: Case) -> tuple[Decision, Snapshot]:
    views = _views(case.loads, case.unhealthy, case.models)
    snap = _snapshot(views, case.held)
    engine = build_engine(case.policy)
    request = RouteRequest(key=_key(), model=case.model, cost_tokens=case.cost)
    return engine.route(request, snap, exclude=case.exclude), snap


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_policy_table(case: Case) -> None:
    decision, _ = _route(case)
    assert decision.worker_id == case.expect
    assert decision.policy == case.policy
    if case.exact_reason:
        assert decision.reason == case.reason
    else:
        assert decision.reason.startswith(case.reason), decision.reason
    assert decision.match_blocks == case.match_blocks
    assert all(0.0 <= s <= 1.0 for s in decision.scores.values())
    assert decision.worker_id not in case.exclude


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_load_bound_reported_by_bounded_policies(case: Case) -> None:
    decision, snap = _route(case)
    if case.policy not in ("bounded_hash", "prefix_affinity"):
        assert decision.load_bound is None
        return
    candidates = [
        w for w in snap.workers
        if w.healthy and w.worker.serves(case.model) and w.id not in case.exclude
    ]
    total = sum(w.inflight_tokens for w in candidates)
    floor = PolicyOptions().load_floor_requests * case.cost
    expected = max(C * (1 / len(candidates)) * (total + case.cost), floor)
    assert decision.load_bound is not None
    assert decision.load_bound == pytest.approx(expected)
    assert decision.worker.inflight_tokens <= decision.load_bound


def test_bound_formula_in_the_table_comment() -> None:
    assert load_bound(1.25, 1000, 100, 0.25) == pytest.approx(343.75)
    assert load_bound(1.25, 1500, 100, 0.25) == pytest.approx(500.0)
    # The floor: with one request in flight in an idle pool, a second one may still join it.
    assert load_bound(1.25, 100, 100, 0.25) == pytest.approx(62.5)
    assert load_bound(1.25, 100, 100, 0.25, floor_requests=1.0) == pytest.approx(100.0)


@pytest.mark.parametrize(("floor", "expected"), [(0.0, "w1"), (1.0, "w0")])
def test_floor_keeps_a_lightly_loaded_owner(floor: float, expected: str) -> None:
    """w0 (the ring owner) runs one request, the rest idle: only the floor keeps w0."""
    engine = build_engine("bounded_hash", PolicyOptions(load_floor_requests=floor))
    views = _views({"w0": 100})
    snap = Snapshot(workers=views, index=PrefixIndex().at(0.0), ring=RING4)
    decision = engine.route(RouteRequest(_key(), MODEL, 100), snap)
    assert decision.worker_id == expected


# -- round robin -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("unhealthy", "expected"),
    [
        pytest.param(frozenset(), ["w0", "w1", "w2", "w3", "w0", "w1", "w2", "w3"], id="all"),
        pytest.param(frozenset({"w2"}), ["w0", "w1", "w3", "w0", "w1", "w3"], id="skip-w2"),
        pytest.param(frozenset({"w0", "w1", "w3"}), ["w2", "w2", "w2"], id="only-w2"),
    ],
)
def test_round_robin_cycles_through_healthy_workers(
    unhealthy: frozenset[str], expected: list[str]
) -> None:
    engine = build_engine("round_robin")
    snap = _snapshot(_views(unhealthy=unhealthy), held={"w3": 8})
    got = [
        engine.route(RouteRequest(_key(), MODEL, 100), snap).worker_id for _ in expected
    ]
    assert got == expected


def test_round_robin_engines_have_their_own_turn() -> None:
    snap = _snapshot(_views())
    a, b = build_engine("round_robin"), build_engine("round_robin")
    request = RouteRequest(_key(), MODEL, 100)
    assert a.route(request, snap).worker_id == "w0"
    assert a.route(request, snap).worker_id == "w1"
    assert b.route(request, snap).worker_id == "w0"


# -- consistent hashing across anchors --------------------------------------------------------


@pytest.mark.parametrize("policy", ["consistent_hash", "bounded_hash", "prefix_affinity"])
def test_same_anchor_same_worker(policy: str) -> None:
    snap = _snapshot(_views())
    rnd = random.Random(99)
    for _ in range(200):
        anchor = rnd.getrandbits(64)
        key = _key(blocks=(rnd.getrandbits(64),), anchor=anchor)
        request = RouteRequest(key, MODEL, 100)
        first = build_engine(policy).route(request, snap).worker_id
        again = build_engine(policy).route(request, snap).worker_id
        assert first == again == RING4.owner(anchor)


def test_consistent_hash_unhealthy_owner_goes_to_next_in_walk() -> None:
    rnd = random.Random(7)
    engine = build_engine("consistent_hash")
    for _ in range(100):
        anchor = rnd.getrandbits(64)
        walk = list(RING4.walk(anchor))
        snap = _snapshot(_views(unhealthy=frozenset({walk[0]})))
        decision = engine.route(RouteRequest(_key(anchor=anchor), MODEL, 1), snap)
        assert decision.worker_id == walk[1]


# -- no candidates, bad names -----------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize(
    ("unhealthy", "models", "exclude"),
    [
        pytest.param(frozenset(IDS), {}, frozenset(), id="none-healthy"),
        pytest.param(frozenset(), {w: OTHER for w in IDS}, frozenset(), id="none-serves-model"),
        pytest.param(frozenset(), {}, frozenset(IDS), id="all-excluded"),
        pytest.param(frozenset({"w0", "w1"}), {}, frozenset({"w2", "w3"}),
                     id="unhealthy-plus-excluded"),
    ],
)
def test_no_candidates(
    policy: str,
    unhealthy: frozenset[str],
    models: dict[str, frozenset[str]],
    exclude: frozenset[str],
) -> None:
    snap = _snapshot(_views(unhealthy=unhealthy, models=models), held={"w1": 8})
    with pytest.raises(NoCandidates):
        build_engine(policy).route(RouteRequest(_key(), MODEL, 100), snap, exclude=exclude)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_empty_pool_raises_no_candidates(policy: str) -> None:
    snap = Snapshot(workers=(), index=PrefixIndex().at(0.0), ring=Ring({}))
    with pytest.raises(NoCandidates):
        build_engine(policy).route(RouteRequest(_key(), MODEL, 100), snap)


@pytest.mark.parametrize("name", ["", "prefix-affinity", "random", "ROUND_ROBIN"])
def test_unknown_policy_raises(name: str) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        build_engine(name)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_engine_name(policy: str) -> None:
    assert build_engine(policy).name == policy


@pytest.mark.parametrize("c", [0.0, 0.99])
def test_bounded_load_factor_below_one_rejected(c: float) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BoundedLoadFilter(c)


def test_worker_without_models_serves_any_model() -> None:
    snap = _snapshot(_views(models={"w0": frozenset({"a"}), "w1": frozenset({"b"})}))
    engine = build_engine("consistent_hash")
    assert engine.route(RouteRequest(_key(), "a", 1), snap).worker_id == "w0"
    assert engine.route(RouteRequest(_key(), "b", 1), snap).worker_id == "w1"
    assert engine.route(RouteRequest(_key(), "c", 1), snap).worker_id == "w2"


def test_worker_not_on_ring_still_routable() -> None:
    views = _views()
    snap = Snapshot(workers=views, index=PrefixIndex().at(0.0), ring=Ring({}))
    decision = build_engine("consistent_hash").route(RouteRequest(_key(), MODEL, 1), snap)
    assert decision.worker_id == "w0"
    assert decision.reason == "ring (not on ring)"


# -- property: the chosen worker never exceeds its bound ---------------------------------------

_RINGS: dict[tuple[tuple[str, float], ...], Ring] = {}


def _ring_for(weights: dict[str, float]) -> Ring:
    key = tuple(sorted(weights.items()))
    if key not in _RINGS:
        _RINGS[key] = Ring(weights)
    return _RINGS[key]


@pytest.mark.parametrize("policy", ["bounded_hash", "prefix_affinity"])
@pytest.mark.parametrize("c", [1.0, 1.25, 2.0])
def test_chosen_worker_within_load_bound(policy: str, c: float) -> None:
    rnd = random.Random(f"{policy}-{c}")
    floor_requests = rnd.choice((0.0, 1.0))
    engine = build_engine(policy, PolicyOptions(load_factor=c, load_floor_requests=floor_requests))
    some_over_bound = 0  # cases where the bound filtered someone out: the test must see many
    for _ in range(300):
        n = rnd.randint(1, 6)
        ids = [f"w{i}" for i in range(n)]
        weights = {wid: rnd.choice((1.0, 1.0, 2.0, 0.5)) for wid in ids}
        healthy = {wid: rnd.random() > 0.2 for wid in ids}
        healthy[rnd.choice(ids)] = True
        views = tuple(
            WorkerView(
                Worker(wid, f"http://{wid}", weight=weights[wid]),
                healthy=healthy[wid],
                inflight_tokens=rnd.choice((0, rnd.randint(0, 500), rnd.randint(0, 20_000))),
            )
            for wid in ids
        )
        index = PrefixIndex()
        blocks = tuple(rnd.getrandbits(64) for _ in range(rnd.randint(1, 12)))
        for wid in ids:
            if rnd.random() < 0.4:
                index.record(blocks[: rnd.randint(1, len(blocks))], wid, 0.0)
        snap = Snapshot(workers=views, index=index.at(0.0), ring=_ring_for(weights))
        cost = rnd.randint(1, 3000)
        key = PrefixKey(blocks=blocks, anchor=rnd.getrandbits(64), text_chars=64)
        decision = engine.route(RouteRequest(key, MODEL, cost), snap)

        candidates = [v for v in views if v.healthy]
        total = sum(v.inflight_tokens for v in candidates)
        share = decision.worker.worker.weight / sum(v.worker.weight for v in candidates)
        bound = max(c * share * (total + cost), floor_requests * cost)
        weight_sum = sum(v.worker.weight for v in candidates)
        bounds = {
            v.id: load_bound(c, total, cost, v.worker.weight / weight_sum, floor_requests)
            for v in candidates
        }
        some_over_bound += any(v.inflight_tokens > bounds[v.id] for v in candidates)
        assert decision.worker.healthy
        assert decision.worker.inflight_tokens <= bound + 1e-9
        assert decision.load_bound == pytest.approx(bound)
        if policy == "prefix_affinity" and decision.match_blocks:
            # A holder was chosen: no candidate within the bound holds a longer prefix.
            matches = index.match(blocks, 0.0)
            eligible = [
                v for v in candidates
                if v.inflight_tokens <= bounds[v.id]
            ]
            assert decision.match_blocks == max(matches.get(v.id, 0) for v in eligible)
    assert some_over_bound >= 30


# -- cache_aware's hard bound guards only engines that make requests wait ----------------------


@pytest.mark.parametrize(("first_token_s", "quick_s", "expect_kept"), [
    (None, 0.02, False),  # the engine does not say: bounded
    (0.5, 0.02, False),  # its requests wait half a second for a first token: bounded
    (0.005, 0.02, True),  # they start within 5 ms: no bound, the holder keeps its prefix
    (0.005, 0.0, False),  # the exemption off
])
def test_cache_aware_bounds_a_holder_only_where_requests_wait(
    first_token_s: float | None, quick_s: float, expect_kept: bool
) -> None:
    # w2 holds the whole prompt with 3,000 tokens in flight; the others 100 each. The hard
    # bound (3 x mean, with the 8 held blocks' tokens as credit) is far below 3,000.
    views = tuple(
        WorkerView(Worker(v.id, v.worker.url), inflight_requests=v.inflight_requests,
                   inflight_tokens=v.inflight_tokens,
                   first_token_s=first_token_s if v.id == "w2" else 0.005)
        for v in _views({"w0": 100, "w1": 100, "w2": 3000, "w3": 100})
    )
    snap = _snapshot(views, {"w2": 8})
    engine = build_engine("cache_aware", PolicyOptions(quick_first_token_s=quick_s))
    decision = engine.route(RouteRequest(key=_key(), model=MODEL, cost_tokens=100,
                                         prompt_tokens=128), snap)
    if expect_kept:
        assert (decision.worker_id, decision.match_blocks) == ("w2", 8)
        assert decision.reason.startswith("prefix_hit"), decision.reason
    else:
        assert decision.worker_id != "w2"
        assert "bounded_load" in decision.reason, decision.reason


def test_quick_first_token_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="quick_first_token_s"):
        PolicyOptions(quick_first_token_s=-1.0)
