"""The routing session: the bookkeeping around each decision, table-driven where it branches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from gateway.fingerprint import PrefixKey
from gateway.pool import WorkerPool
from gateway.routing.policies import build_engine
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import DecisionKind, NoCandidates, RouteRequest
from gateway.session import Attempt, CacheUsage, RoutingSession
from gateway.store.base import CacheReport

IDS = ("a:1", "b:1", "c:1")
BLOCKS = (11, 12, 13, 14, 15, 16, 17, 18)


@dataclass
class Sink:
    assignments: list[tuple[tuple[int, ...], str]]
    reports: list[CacheReport]

    def assigned(self, key: PrefixKey, worker_id: str) -> None:
        self.assignments.append((key.blocks, worker_id))

    def reported(self, report: CacheReport) -> None:
        self.reports.append(report)

    def catch_up(self, now: float) -> None:
        return None


def _session(policy: str = "cache_aware") -> tuple[RoutingSession, Sink]:
    index = PrefixIndex()
    pool = WorkerPool((), index)
    for wid in IDS:
        pool.add(f"http://{wid.replace(':1', '')}:1", wid=wid)
        pool.mark_up(wid, frozenset())
    sink = Sink([], [])
    return RoutingSession(build_engine(policy), index, pool, sink), sink


def _request(blocks: Sequence[int] = BLOCKS, cost: int = 100) -> RouteRequest:
    return RouteRequest(PrefixKey(tuple(blocks), blocks[0], 64 * len(blocks)), "m", cost, 80)


def _inflight(session: RoutingSession) -> dict[str, tuple[int, int]]:
    return {s.worker.id: (s.inflight_requests, s.inflight_tokens)
            for s in session.pool.states()}


def test_route_records_publishes_and_counts_in_flight() -> None:
    session, sink = _session()
    attempt = session.route(_request(), now=5.0, tenant="t1")
    wid = attempt.worker_id
    assert attempt.decision.kind is DecisionKind.COLD
    assert session.index.match(BLOCKS, 5.0) == {wid: len(BLOCKS)}
    assert sink.assignments == [(BLOCKS, wid)]
    assert _inflight(session)[wid] == (1, 100)
    # The same prefix again, a moment later: a hit on the same worker, two in flight.
    again = session.route(_request(), now=6.0)
    assert again.worker_id == wid
    assert again.decision.kind is DecisionKind.PREFIX_HIT
    assert again.decision.match_blocks == len(BLOCKS)
    assert _inflight(session)[wid] == (2, 200)


def test_a_decision_changes_nothing_until_it_is_committed() -> None:
    session, sink = _session()
    first = session.route(_request(), now=1.0)
    decided = session.decide(_request(), now=2.0, tenant="t1")
    wid = decided.worker_id
    assert (decided.worker_id, decided.decision.kind) == (first.worker_id,
                                                          DecisionKind.PREFIX_HIT)
    # Nothing recorded, published or counted in flight yet.
    assert not decided.committed
    assert session.index.last_use(wid, BLOCKS[-1]) == session.index.last_use(
        first.worker_id, BLOCKS[-1])
    assert len(sink.assignments) == 1
    assert _inflight(session)[wid] == (1, 100)
    session.commit(decided)
    session.commit(decided)  # once only
    assert decided.committed
    assert decided.ticket
    assert len(sink.assignments) == 2
    assert _inflight(session)[wid] == (2, 200)
    # Committed as decided: at the decision's time, not the commit's.
    assert session.index.match(BLOCKS, 2.0) == {wid: len(BLOCKS)}


def test_an_attempt_never_committed_settles_to_nothing() -> None:
    session, sink = _session()
    held = session.route(_request(), now=1.0)
    for settle in ("failed", "completed"):
        attempt = session.decide(_request(), now=2.0)
        if settle == "failed":
            session.failed(attempt)  # would forget the blocks the first attempt recorded
        else:
            session.completed(attempt, CacheUsage(800, 800))
        assert attempt.settled
        assert session.index.match(BLOCKS, 2.0) == {held.worker_id: len(BLOCKS)}
        assert _inflight(session)[held.worker_id] == (1, 100)
        assert sink.reports == []
        session.commit(attempt)  # settled first: committing it later is refused
        assert _inflight(session)[held.worker_id] == (1, 100)


def test_time_is_an_argument_the_index_ttl_follows_it() -> None:
    session, _ = _session()
    wid = session.route(_request(), now=0.0).worker_id
    ttl = 600.0  # PrefixIndex's default; expiry is checked every ttl / 64
    assert session.index.match(BLOCKS, ttl - 1) == {wid: len(BLOCKS)}
    assert session.index.match(BLOCKS, ttl * 1.05) == {}


@dataclass(frozen=True)
class SettleCase:
    name: str
    fail: bool
    usage: CacheUsage | None
    # expected after settling: blocks the worker is still known to hold, reports sent
    held_after: int
    reports: int
    predicted: int = 0


SETTLE = [
    # A failed first attempt: the worker never saw the prompt; everything is undone.
    SettleCase("failed-cold", True, None, held_after=0, reports=0),
    # Completed with the worker's numbers: 800 input tokens, 0 reused; predicted 0 (cold).
    SettleCase("completed-reported", False, CacheUsage(800, 0), held_after=8, reports=1),
    # Completed without numbers (client went away, or the worker reports none).
    SettleCase("completed-silent", False, None, held_after=8, reports=0),
]


@pytest.mark.parametrize("case", SETTLE, ids=[c.name for c in SETTLE])
def test_settling_an_attempt(case: SettleCase) -> None:
    session, sink = _session()
    attempt = session.route(_request(), now=1.0, tenant="t1")
    wid = attempt.worker_id
    if case.fail:
        session.failed(attempt)
    else:
        session.completed(attempt, case.usage)
    assert _inflight(session)[wid] == (0, 0)
    assert session.index.match(BLOCKS, 1.0).get(wid, 0) == case.held_after
    assert len(sink.reports) == case.reports
    if case.reports:
        report = sink.reports[0]
        assert (report.worker_id, report.tenant, report.input_tokens, report.matched_tokens,
                report.predicted_tokens) == (wid, "t1", 800, 0, case.predicted)
    # Settling twice changes nothing (the proxy's finally clause settles every attempt).
    session.completed(attempt, CacheUsage(800, 800))
    session.failed(attempt)
    assert _inflight(session)[wid] == (0, 0)
    assert len(sink.reports) == case.reports


def test_a_failed_retry_forgets_only_what_the_decision_added() -> None:
    session, sink = _session()
    first = session.route(_request(BLOCKS[:4]), now=1.0)
    session.completed(first)
    wid = first.worker_id
    # The longer prompt hits 4 known blocks there; the attempt fails before the worker saw it.
    retry = session.route(_request(), now=2.0)
    assert (retry.worker_id, retry.decision.match_blocks) == (wid, 4)
    session.failed(retry)
    assert session.index.match(BLOCKS, 2.0) == {wid: 4}
    # The prediction for a completed hit is proportional to the known depth: 4 of 8 blocks.
    hit = session.route(_request(), now=3.0)
    session.completed(hit, CacheUsage(800, 400))
    assert sink.reports[-1].predicted_tokens == 400


def test_excluded_workers_are_not_chosen_and_none_left_raises() -> None:
    session, _ = _session()
    tried: set[str] = set()
    attempts: list[Attempt] = []
    for _ in IDS:
        attempt = session.route(_request(), now=1.0, exclude=frozenset(tried))
        assert attempt.worker_id not in tried
        tried.add(attempt.worker_id)
        attempts.append(attempt)
        session.failed(attempt)
    with pytest.raises(NoCandidates):
        session.route(_request(), now=1.0, exclude=frozenset(tried))


def test_policies_without_an_index_record_nothing() -> None:
    session, sink = _session("round_robin")
    attempt = session.route(_request(), now=1.0)
    assert attempt.decision.kind is DecisionKind.PLACED
    assert attempt.decision.label == "round_robin"
    assert session.index.match(BLOCKS, 1.0) == {}
    assert sink.assignments == []


def test_queued_prefill_counts_until_the_first_token() -> None:
    session, _ = _session()
    cold = session.route(_request(cost=100), now=1.0)  # prompt 80 tokens, nothing cached
    wid = cold.worker_id
    assert session.pool.get(wid).inflight_prefill == 80
    views = session.pool.snapshot(1.0).by_id
    assert views is not None
    assert views[wid].inflight_prefill == 80  # what routing sees
    session.first_token(cold)
    session.first_token(cold)  # once only
    assert session.pool.get(wid).inflight_prefill == 0
    session.completed(cold)
    hit = session.route(_request(cost=100), now=2.0)  # all 8 blocks known: nothing to prefill
    assert (hit.worker_id, hit.prefill_tokens) == (wid, 0)
    half = session.route(_request((*BLOCKS[:4], 91, 92, 93, 94)), now=3.0)
    assert (half.worker_id, half.prefill_tokens) == (wid, 40)  # 4 of 8 blocks held
    # Routing sees each request in flight there: its checkpoints and predicted cached tokens.
    views = session.pool.snapshot(3.0).by_id
    assert views is not None
    assert sorted(views[wid].inflight_prompts) == sorted(
        [(BLOCKS, 80), ((*BLOCKS[:4], 91, 92, 93, 94), 40)])
    session.failed(hit)
    session.completed(half)  # never streamed: its prefill is released with it
    state = session.pool.get(wid)
    assert (state.inflight_requests, state.inflight_tokens, state.inflight_prefill) == (0, 0, 0)
    assert state.inflight_prompts == {}


@dataclass(frozen=True)
class LearnCase:
    name: str
    reported_capacity: int  # 0: the worker does not report its cache size
    matched_tokens: int  # of 800 input tokens (8 blocks, all predicted held)
    expected_capacity: int


LEARN = [
    # It reused everything predicted: nothing to learn (the index's default size stays).
    LearnCase("confirmed", 0, 800, 1_000_000),
    # It reused nothing of 8 predicted blocks: it evicted them, and with them the other prompt
    # it had used before them; what is left is this prompt, recorded again: 8 blocks.
    LearnCase("evicted-shrinks", 0, 0, 8),
    # One block short is within the slack: nothing to learn.
    LearnCase("near-miss-ignored", 0, 700, 1_000_000),
    # A worker that reports its size keeps it (the rebalancer corrects those).
    LearnCase("reported-kept", 100, 0, 100),
]


@pytest.mark.parametrize("case", LEARN, ids=[c.name for c in LEARN])
def test_capacity_is_learned_from_what_workers_reuse(case: LearnCase) -> None:
    session, _ = _session()
    wid = session.route(_request(tuple(range(100, 108))), now=0.0).worker_id
    if case.reported_capacity:
        session.pool.set_capacity(wid, case.reported_capacity)
    first = session.route(_request(), now=1.0, exclude=frozenset(set(IDS) - {wid}))
    session.completed(first)
    again = session.route(_request(), now=2.0)
    assert (again.worker_id, again.decision.match_blocks) == (wid, 8)
    session.completed(again, CacheUsage(800, case.matched_tokens))
    assert session.index.capacity(wid) == case.expected_capacity


def test_a_miss_drops_what_the_worker_used_before_the_missed_prefix() -> None:
    index = PrefixIndex()
    pool = WorkerPool((), index)
    pool.add("http://a:1", wid="a:1")
    pool.mark_up("a:1", frozenset())
    session = RoutingSession(build_engine("cache_aware"), index, pool)
    prompts = [tuple(range(base, base + 8)) for base in (100, 200, 300, 400)]  # A, B, C, D
    for t, prompt in enumerate(prompts):
        session.completed(session.route(_request(prompt), now=float(t)))
    assert index.held_blocks("a:1") == 32
    again = session.route(_request(prompts[2]), now=4.0)  # C, predicted held
    assert again.decision.match_blocks == 8
    session.completed(again, CacheUsage(800, 0))  # ...but the worker had evicted it
    # An LRU evicts what it used less recently first: A and B went before C; D, used after
    # C, may still be there, and C is there again. The worker holds at most those 16 blocks.
    assert index.match(prompts[0], 5.0) == {}
    assert index.match(prompts[1], 5.0) == {}
    assert index.match(prompts[2], 5.0) == {"a:1": 8}
    assert index.match(prompts[3], 5.0) == {"a:1": 8}
    assert index.capacity("a:1") == 16


def test_a_learned_capacity_grows_back_when_the_worker_holds_more() -> None:
    session, _ = _session()
    wid = session.route(_request(), now=0.0).worker_id
    session.index.set_capacity(wid, 8)  # learned too small: only one prompt fits
    other = session.route(_request(tuple(range(100, 108))), now=1.0,
                          exclude=frozenset(set(IDS) - {wid}))
    session.completed(other)
    assert session.index.match(BLOCKS, 1.0) == {}  # the model evicted it
    attempt = session.route(_request(), now=2.0, exclude=frozenset(set(IDS) - {wid}))
    session.completed(attempt, CacheUsage(800, 800))  # ...but the worker still had it all
    assert session.index.capacity(wid) == 16


def test_capacity_learning_can_be_switched_off() -> None:
    index = PrefixIndex()
    pool = WorkerPool((), index)
    pool.add("http://a:1", wid="a:1")
    pool.mark_up("a:1", frozenset())
    session = RoutingSession(build_engine("cache_aware"), index, pool, learn_capacity=False)
    session.completed(session.route(_request(tuple(range(100, 108))), now=0.0))
    session.completed(session.route(_request(), now=1.0))
    again = session.route(_request(), now=2.0)
    session.completed(again, CacheUsage(800, 0))
    assert index.capacity("a:1") == 1_000_000


def test_the_first_size_learnt_is_every_unknown_workers_until_its_own() -> None:
    """Workers that do not report their cache size are modelled unbounded until their first
    miss; the first size learnt becomes that of every worker of the same model still unknown
    (per unit of ring weight), so none looks emptier than the rest to the placement. A worker
    that reports its size, one of another model and one already learnt keep theirs."""
    index = PrefixIndex()
    pool = WorkerPool((), index)
    for wid, models, weight in (("a:1", {"m"}, 1.0), ("b:1", {"m"}, 2.0), ("c:1", {"m"}, 1.0),
                                ("d:1", {"other"}, 1.0), ("e:1", {"m"}, 1.0)):
        pool.add(f"http://{wid[0]}:1", wid=wid, weight=weight)
        pool.mark_up(wid, frozenset(models))
    pool.set_capacity("c:1", 100)  # reported
    index.set_capacity("e:1", 50)  # learnt before
    session = RoutingSession(build_engine("cache_aware"), index, pool)
    only_a = frozenset(s.worker.id for s in pool.states()) - {"a:1"}
    session.completed(session.route(_request(tuple(range(100, 108))), now=0.0, exclude=only_a))
    session.completed(session.route(_request(), now=1.0, exclude=only_a))
    again = session.route(_request(), now=2.0, exclude=only_a)
    assert again.decision.match_blocks == 8
    session.completed(again, CacheUsage(800, 0))  # a:1 had evicted it: its size is learnt
    assert index.capacity("a:1") == 8
    assert {wid: index.capacity(wid) for wid in ("b:1", "c:1", "d:1", "e:1")} == {
        "b:1": 16, "c:1": 100 - pool.private_blocks, "d:1": 1_000_000, "e:1": 50}


def test_without_the_fleet_prior_only_the_worker_that_missed_learns() -> None:
    index = PrefixIndex()
    pool = WorkerPool((), index)
    for wid in ("a:1", "b:1"):
        pool.add(f"http://{wid[0]}:1", wid=wid)
        pool.mark_up(wid, frozenset({"m"}))
    session = RoutingSession(build_engine("cache_aware"), index, pool, fleet_prior=False)
    only_a = frozenset({"b:1"})
    session.completed(session.route(_request(tuple(range(100, 108))), now=0.0, exclude=only_a))
    session.completed(session.route(_request(), now=1.0, exclude=only_a))
    session.completed(session.route(_request(), now=2.0, exclude=only_a), CacheUsage(800, 0))
    assert (index.capacity("a:1"), index.capacity("b:1")) == (8, 1_000_000)
