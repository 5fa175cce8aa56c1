"""Tests for gateway.routing.ring.Ring: walk order, determinism, minimal movement, weights."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from gateway.routing.ring import Ring

N_ANCHORS = 10_000


def _anchors(n: int = N_ANCHORS, seed: int = 1234) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.getrandbits(64) for _ in range(n)]


ANCHORS = _anchors()
FOUR = {f"w{i}": 1.0 for i in range(4)}
FIVE = {**FOUR, "w4": 1.0}


def _owners(ring: Ring, anchors: list[int]) -> list[str | None]:
    return [ring.owner(a) for a in anchors]


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param({}, id="empty"),
        pytest.param({"solo": 1.0}, id="one"),
        pytest.param({"a": 1.0, "b": 1.0}, id="two"),
        pytest.param(FIVE, id="five"),
        pytest.param({"a": 3.0, "b": 0.5, "c": 1.0}, id="weighted"),
    ],
)
def test_walk_returns_every_member_once(weights: dict[str, float]) -> None:
    ring = Ring(weights)
    assert ring.members == tuple(sorted(weights))
    for anchor in _anchors(200, seed=5):
        walk = list(ring.walk(anchor))
        assert sorted(walk) == sorted(weights)
        assert len(set(walk)) == len(walk)
        assert ring.owner(anchor) == (walk[0] if walk else None)


def test_empty_ring_has_no_owner() -> None:
    assert Ring({}).owner(42) is None


def test_walk_deterministic_across_instances() -> None:
    a = Ring(FIVE)
    b = Ring(dict(reversed(list(FIVE.items()))))  # insertion order does not matter
    for anchor in ANCHORS[:500]:
        assert list(a.walk(anchor)) == list(b.walk(anchor))


def test_walk_is_lazy() -> None:
    walk = Ring(FIVE).walk(7)
    assert next(walk) in FIVE


def test_owners_spread_over_members() -> None:
    counts = Counter(_owners(Ring(FIVE), ANCHORS))
    assert set(counts) == set(FIVE)
    for wid in FIVE:
        assert 0.12 < counts[wid] / N_ANCHORS < 0.30, counts


def test_adding_a_worker_moves_about_a_fifth_to_it() -> None:
    before = _owners(Ring(FOUR), ANCHORS)
    after = _owners(Ring(FIVE), ANCHORS)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert 0.12 <= len(moved) / N_ANCHORS <= 0.30
    assert all(a == "w4" for _, a in moved)
    assert after.count("w4") == len(moved)


def test_removing_a_worker_moves_only_its_anchors() -> None:
    before = _owners(Ring(FIVE), ANCHORS)
    after = _owners(Ring({k: v for k, v in FIVE.items() if k != "w2"}), ANCHORS)
    for b, a in zip(before, after, strict=True):
        if b == "w2":
            assert a != "w2"
        else:
            assert a == b


def test_removed_owner_anchors_go_to_next_in_walk() -> None:
    five = Ring(FIVE)
    four = Ring({k: v for k, v in FIVE.items() if k != "w2"})
    for anchor in ANCHORS[:1000]:
        expected = [w for w in five.walk(anchor) if w != "w2"]
        assert list(four.walk(anchor)) == expected


def test_weight_two_owns_about_twice() -> None:
    weights = {"heavy": 2.0, "a": 1.0, "b": 1.0, "c": 1.0}
    counts = Counter(_owners(Ring(weights), ANCHORS))
    light = (counts["a"] + counts["b"] + counts["c"]) / 3
    assert 1.5 <= counts["heavy"] / light <= 2.7, counts
    assert 0.28 <= counts["heavy"] / N_ANCHORS <= 0.52, counts


def test_removing_a_worker_moves_only_its_anchors_weighted() -> None:
    weights = {"heavy": 2.0, "a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}
    before = _owners(Ring(weights), ANCHORS)
    after = _owners(Ring({k: v for k, v in weights.items() if k != "d"}), ANCHORS)
    moved_between_survivors = sum(
        1 for b, a in zip(before, after, strict=True) if b != "d" and a != b
    )
    assert moved_between_survivors == 0


def _uhashring(weights: dict[str, float]) -> Any:
    """uhashring's ketama ring with the point counts the gateway gives each worker."""
    from uhashring import HashRing

    nodes = {wid: {"vnodes": max(1, round(40 * w)), "weight": 1} for wid, w in weights.items()}
    return HashRing(nodes=nodes, hash_fn="ketama")


UHASHRING_CASES = [
    pytest.param({f"10.0.0.{i}:8001": 1.0 for i in range(7)}, id="equal"),
    pytest.param({f"w{i:02d}": (2.0 if i % 4 == 0 else 1.0) for i in range(16)}, id="2-to-1"),
    pytest.param({"a": 3.0, "b": 0.5, "c": 1.0, "d": 0.01}, id="fractional"),
]


@pytest.mark.parametrize("weights", UHASHRING_CASES)
def test_continuum_is_uhashrings_ketama_continuum(weights: dict[str, float]) -> None:
    ring = Ring(weights)
    reference = _uhashring(weights)
    assert list(zip(ring._keys, ring._owners, strict=True)) == reference.get_points()


@pytest.mark.parametrize("weights", UHASHRING_CASES)
def test_owner_and_walk_match_uhashring(weights: dict[str, float]) -> None:
    ring = Ring(weights)
    reference = _uhashring(weights)
    for anchor in ANCHORS[:2000]:
        key = f"{anchor:016x}"  # how the ring hashes an anchor
        assert ring.owner(anchor) == reference.get_node(key)
        assert list(ring.walk(anchor)) == list(reference.iterate_nodes(key))


def test_uhashrings_own_weights_would_move_anchors_between_other_workers() -> None:
    """Why weights become point counts: uhashring sizes a node relative to the summed weights,
    so one worker's new weight moves anchors between two others; here it does not."""
    from uhashring import HashRing

    before = {f"w{i}": 1 for i in range(6)}
    after = {**before, "w0": 3}
    theirs_before = HashRing(nodes=before, hash_fn="ketama")
    theirs_after = HashRing(nodes=after, hash_fn="ketama")
    keys = [f"{a:016x}" for a in ANCHORS[:3000]]
    moved_theirs = sum(
        1 for k in keys
        if "w0" not in (theirs_before.get_node(k), theirs_after.get_node(k))
        and theirs_before.get_node(k) != theirs_after.get_node(k)
    )
    assert moved_theirs > 0
    ours_before = _owners(Ring({k: float(v) for k, v in before.items()}), ANCHORS[:3000])
    ours_after = _owners(Ring({k: float(v) for k, v in after.items()}), ANCHORS[:3000])
    moved_ours = sum(
        1 for b, a in zip(ours_before, ours_after, strict=True) if "w0" not in (b, a) and b != a
    )
    assert moved_ours == 0
