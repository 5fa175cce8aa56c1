"""The pool's view of load: gateway counts, other replicas' shares, the engine's own report."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from gateway import pool as pool_module
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring

URL = "http://10.0.0.1:8001"
WID = "10.0.0.1:8001"


def _view_load(pool: WorkerPool) -> tuple[int, int]:
    view = pool.snapshot(0.0).workers[0]
    return view.inflight_requests, view.inflight_tokens


def test_local_and_remote_load_add_up() -> None:
    pool = WorkerPool([URL], PrefixIndex())
    pool.acquire(WID, 100)
    pool.set_remote_load({WID: 250})
    assert _view_load(pool) == (1, 350)
    pool.release(WID, 100)
    assert _view_load(pool) == (0, 250)


def test_engine_metrics_reveal_load_no_replica_shared() -> None:
    pool = WorkerPool([URL], PrefixIndex())
    pool.acquire(WID, 200)
    pool.release(WID, 200)  # the gateway's mean request cost is now 200 tokens
    pool.mark_up(WID, frozenset({"m"}), {"vllm:num_requests_running": 3.0,
                                         "vllm:num_requests_waiting": 2.0})
    assert _view_load(pool) == (5, 1000)  # 5 requests the gateway never sent, at 200 each
    pool.acquire(WID, 200)
    pool.acquire(WID, 200)
    # Ours add to what the engine ran for others; in tokens, the other replicas' count is
    # larger than the engine's estimate: it wins.
    pool.set_remote_load({WID: 1000})
    assert _view_load(pool) == (7, 1400)
    # The next scrape sees our 2 among its 3: one request comes from elsewhere now.
    pool.mark_up(WID, frozenset({"m"}), {"vllm:num_requests_running": 3.0})
    pool.set_remote_load({WID: 0})
    assert _view_load(pool) == (3, 600)
    pool.release(WID, 200)
    pool.release(WID, 200)  # ours finished: the scrape's count of them is not load any more
    assert _view_load(pool) == (1, 200)


def test_waiting_requests_follow_the_gateways_count_once_the_engine_was_seen_full() -> None:
    pool = WorkerPool([URL], PrefixIndex())

    def waiting() -> int:
        return pool.snapshot(0.0).workers[0].waiting_requests

    pool.mark_up(WID, frozenset({"m"}), {"vllm:num_requests_running": 1.0,
                                         "vllm:num_requests_waiting": 0.0})
    assert waiting() == 0
    for _ in range(4):
        pool.acquire(WID, 100)
    assert waiting() == 0  # the engine was never seen full: its limit is unknown
    pool.mark_up(WID, frozenset({"m"}), {"vllm:num_requests_running": 2.0,
                                         "vllm:num_requests_waiting": 2.0})
    assert waiting() == 2  # it runs 2 at once: of the 4 sent, 2 wait
    pool.acquire(WID, 100)
    assert waiting() == 3  # counted at once, not at the next scrape
    for _ in range(4):
        pool.release(WID, 100)
    assert waiting() == 2  # what the engine last said: other senders may still queue there
    pool.mark_up(WID, frozenset({"m"}), {"vllm:num_requests_running": 1.0,
                                         "vllm:num_requests_waiting": 0.0})
    assert waiting() == 0
    # Shorter prompts: the engine now runs 4 at once with none waiting; the limit follows.
    pool.mark_up(WID, frozenset({"m"}), {"vllm:num_requests_running": 4.0,
                                         "vllm:num_requests_waiting": 0.0})
    for _ in range(5):
        pool.acquire(WID, 100)
    assert waiting() == 2  # 6 in flight (one was still there), 4 run


def test_ring_is_rebuilt_once_per_burst_of_changes() -> None:
    pool = WorkerPool([], PrefixIndex())
    for i in range(5):
        pool.add(f"http://10.0.0.{i}:8001")
    ring = pool.ring
    assert ring.members == tuple(sorted(f"10.0.0.{i}:8001" for i in range(5)))
    assert pool.ring is ring  # no change, no rebuild
    pool.set_weights({"10.0.0.0:8001": 2.0})
    assert pool.ring is not ring


def test_a_deferred_rebuild_is_scheduled_once_per_burst_and_builds_the_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[Ring] = []

    class CountedRing(Ring):
        def __init__(self, weights: Mapping[str, float]) -> None:
            super().__init__(weights)
            built.append(self)

    monkeypatch.setattr(pool_module, "Ring", CountedRing)
    pool = WorkerPool([], PrefixIndex())
    scheduled: list[Callable[[], None]] = []
    pool.defer = scheduled.append
    for i in range(3):
        pool.add(f"http://10.0.0.{i}:8001")
    pool.set_weights({"10.0.0.0:8001": 2.0})
    assert len(scheduled) == 1  # one rebuild for the burst ...
    assert len(built) == 1  # ... not made yet (the first: the empty pool's)
    scheduled.pop()()
    assert len(built) == 2  # made by the deferred call ...
    assert pool.snapshot(0.0).ring is built[-1]  # ... so the next decision makes none
    assert built[-1].members == ("10.0.0.0:8001", "10.0.0.1:8001", "10.0.0.2:8001")
    pool.remove("10.0.0.2:8001")  # the next change schedules the next rebuild
    assert len(scheduled) == 1
    scheduled.pop()()
    assert len(built) == 3
    assert pool.ring.members == ("10.0.0.0:8001", "10.0.0.1:8001")


def test_a_ring_change_made_before_its_deferred_rebuild_runs_is_seen_at_once() -> None:
    pool = WorkerPool(["http://10.0.0.0:8001"], PrefixIndex())
    pool.defer = lambda rebuild: None  # never runs: the snapshot still sees the change
    pool.add("http://10.0.0.1:8001")
    assert pool.ring.members == ("10.0.0.0:8001", "10.0.0.1:8001")


def test_snapshot_totals_follow_every_change() -> None:
    index = PrefixIndex()
    pool = WorkerPool([f"http://10.0.0.{i}:8001" for i in range(3)], index)
    ids = [f"10.0.0.{i}:8001" for i in range(3)]

    def expected() -> tuple[int, float]:
        views = [v for v in pool.snapshot(0.0).workers if v.healthy]
        return sum(v.inflight_tokens for v in views), sum(v.worker.weight for v in views)

    for wid in ids:
        pool.mark_up(wid, frozenset({"m"}))
    steps: list[Callable[[], object]] = [
        lambda: pool.acquire(ids[0], 100),
        lambda: pool.acquire(ids[1], 50),
        lambda: pool.set_remote_load({ids[2]: 70}),
        lambda: pool.mark_down(ids[1], "test"),
        lambda: pool.set_weights({ids[0]: 2.0}),
        lambda: pool.release(ids[0], 100),
        lambda: pool.remove(ids[2]),
        lambda: pool.mark_up(ids[1], frozenset({"m"})),
    ]
    for step in steps:
        step()
        snap = pool.snapshot(0.0)
        assert snap.pool_load == expected()
        assert snap.by_id is not None
        assert set(snap.by_id) == {v.id for v in snap.workers}


def test_an_engine_that_turns_its_queue_over_in_milliseconds_has_nobody_waiting() -> None:
    pool = WorkerPool([URL], PrefixIndex())

    def scrape(waiting: float, queue_sum: float, queue_count: float) -> int:
        pool.mark_up(WID, frozenset({"m"}), {
            "vllm:num_requests_running": 8.0, "vllm:num_requests_waiting": waiting,
            "vllm:request_queue_time_seconds_sum": queue_sum,
            "vllm:request_queue_time_seconds_count": queue_count})
        return pool.snapshot(0.0).workers[0].waiting_requests

    assert scrape(3.0, 0.0, 0.0) == 3  # nothing admitted yet: what the engine reports
    assert scrape(3.0, 0.2, 200.0) == 0  # 200 admitted after 1 ms each: no real queue
    assert scrape(5.0, 60.2, 300.0) == 5  # the next 100 waited 0.6 s each
    assert scrape(5.0, 60.2, 300.0) == 5  # none admitted since, still waiting: unchanged
    assert scrape(0.0, 60.2, 300.0) == 0
    assert scrape(4.0, 60.2, 300.0) == 0  # the queue emptied in between: 0 until admissions
    assert scrape(4.0, 0.9, 3.0) == 4  # counters went back: a restart, no mean known yet


def test_the_time_to_first_token_is_the_mean_of_the_requests_started_since_the_last_scrape(
) -> None:
    pool = WorkerPool([URL], PrefixIndex())

    def scrape(total: float | None, count: float | None) -> float | None:
        metrics = {"vllm:num_requests_running": 1.0}
        if total is not None and count is not None:
            metrics |= {"vllm:time_to_first_token_seconds_sum": total,
                        "vllm:time_to_first_token_seconds_count": count}
        pool.mark_up(WID, frozenset({"m"}), metrics)
        return pool.snapshot(0.0).workers[0].first_token_s

    assert scrape(None, None) is None  # the engine does not say
    assert scrape(0.5, 100.0) == 0.005  # every request it started, 5 ms each
    assert scrape(20.5, 200.0) == 0.2  # the next 100: 0.2 s each
    assert scrape(20.5, 200.0) == 0.2  # none started since: unchanged
    assert scrape(0.01, 1.0) is None  # counters went back: a restart, nothing known
    assert scrape(0.03, 3.0) == pytest.approx(0.01)


def test_predictions_are_counted_exact_over_and_under_with_the_tokens_off() -> None:
    pool = WorkerPool([URL], PrefixIndex())
    for predicted, matched in ((64, 64), (64, 48), (128, 96), (0, 16), (32, 32)):
        pool.record_prediction(WID, predicted, matched)
    pool.record_prediction("10.9.9.9:1", 10, 0)  # a worker the pool no longer has
    (state,) = pool.states()
    assert state.predictions == 5
    assert (state.predicted_exactly, state.predicted_over, state.predicted_under) == (2, 2, 1)
    assert (state.over_tokens, state.under_tokens) == (16 + 32, 16)
