"""Miss classification, table-driven, and the tracker's bookkeeping."""

from __future__ import annotations

import pytest

from gateway.misses import MissTracker, Outcome, classify, prompt_head_hash


def outcome(**kw: object) -> Outcome:
    base: dict[str, object] = dict(
        worker="w1", kind="prefix_hit", match_blocks=8, best_blocks=8, total_blocks=10,
        input_tokens=100, cached_tokens=80,
    )
    base.update(kw)
    return Outcome(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (outcome(), None),  # served what was predicted
        (outcome(cached_tokens=40), None),  # half of the possible 80 counts as reused
        (outcome(cached_tokens=0, restarted=True), "worker_restarted"),
        (outcome(kind="diverted", match_blocks=0, cached_tokens=0), "diverted_by_load"),
        (outcome(kind="spread", match_blocks=2, cached_tokens=16), "diverted_by_load"),
        (outcome(kind="cold", match_blocks=0, best_blocks=1, cached_tokens=0), "cold_placement"),
        # Placed past a shared trunk it branched off, on a worker without the trunk.
        (outcome(kind="branch", match_blocks=0, best_blocks=4, cached_tokens=0),
         "cold_placement"),
        (outcome(cached_tokens=16), "evicted_by_worker"),  # part of it was still there
        (outcome(cached_tokens=0, worker_evicting=True), "evicted_by_worker"),
        (outcome(cached_tokens=0), "stale_index_entry"),
        (outcome(kind="cold", match_blocks=0, best_blocks=0, cached_tokens=0), None),
        (outcome(kind="cold", match_blocks=0, best_blocks=0, cached_tokens=0,
                 namespace_changed=True), "tenant_or_model_changed"),
        (outcome(total_blocks=0, match_blocks=0, best_blocks=0), None),
    ],
)
def test_classify(case: Outcome, expected: str | None) -> None:
    assert classify(case) == expected


def test_possible_and_predicted_tokens() -> None:
    o = outcome(match_blocks=5, best_blocks=8)
    assert o.possible_tokens() == 80
    assert o.predicted_tokens() == 50


def test_tracker_counts_and_keeps_recent_misses_newest_first() -> None:
    tracker = MissTracker(recent=3)
    assert tracker.observe(outcome(), "r0") is None
    for i in range(4):
        assert tracker.observe(outcome(cached_tokens=0), f"r{i + 1}") == "stale_index_entry"
    assert tracker.observe(outcome(worker="w2", cached_tokens=10), "r5") == "evicted_by_worker"
    assert tracker.requests == 6
    assert tracker.counts() == {"w1": {"stale_index_entry": 4}, "w2": {"evicted_by_worker": 1}}
    assert [m.request_id for m in tracker.recent()] == ["r5", "r4", "r3"]
    assert tracker.recent(1)[0].as_dict()["cause"] == "evicted_by_worker"


def test_namespace_change_is_seen_for_the_same_prompt_head() -> None:
    tracker = MissTracker(texts=2)
    head = prompt_head_hash("x" * 300, 256)
    assert head != 0
    assert prompt_head_hash("short", 256) == 0
    assert not tracker.namespace_changed(head, 1)
    assert not tracker.namespace_changed(head, 1)
    assert tracker.namespace_changed(head, 2)
    assert not tracker.namespace_changed(0, 3)  # too short to tell


def test_restarts_from_boot_ids_and_counters() -> None:
    tracker = MissTracker()
    assert not tracker.worker_started("w1", "a")
    assert not tracker.worker_started("w1", "a")
    assert tracker.worker_started("w1", "b")
    assert not tracker.probed("w2", 100.0)
    assert not tracker.probed("w2", 150.0)
    assert not tracker.probed("w2", None)
    assert tracker.probed("w2", 3.0)
    assert tracker.restarted_since("w2", 0.0)
    assert not tracker.restarted_since("w3", 0.0)


def test_each_restart_is_told_once_whichever_fact_shows_it_first() -> None:
    """A restart shows twice: a new start stamp on a reply and cache counters back at the next
    probe. The lifecycle is told once per restart, by the first; a later restart is told
    again."""
    told: list[str] = []
    tracker = MissTracker()
    tracker.on_restart = told.append
    assert not tracker.worker_started("w1", "a")
    assert not tracker.probed("w1", 100.0)
    assert tracker.worker_started("w1", "b")  # the reply first
    assert not tracker.probed("w1", 4.0)  # the same restart, seen by the probe
    assert not tracker.probed("w1", 9.0)
    assert told == ["w1"]
    assert tracker.probed("w1", 2.0)  # the probe first, this time
    assert not tracker.worker_started("w1", "c")  # the same restart, seen on a reply
    assert not tracker.worker_started("w1", "c")
    assert told == ["w1", "w1"]
    assert tracker.worker_started("w1", "d")
    assert told == ["w1", "w1", "w1"]
