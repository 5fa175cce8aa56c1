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
