"""A request's record: work left until its answer is sent runs once, in order, right after
the write (or at the event loop's next pass while a write waits for a slow client), and
before the request is accounted for (the worker's report of an answer feeds the miss
diagnosis)."""

from __future__ import annotations

import asyncio
import time

from gateway.fingerprint import FingerprintOptions, Namespace, fingerprint
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Decision, DecisionKind, RouteRequest, Worker, WorkerView
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.record import RequestRecord, Telemetry


def _telemetry() -> Telemetry:
    return Telemetry(GatewayMetrics(WorkerPool([], PrefixIndex())))


def test_work_left_until_sent_runs_once_in_order() -> None:
    record = RequestRecord(_telemetry(), "req-1", "POST", "/v1/completions")
    done: list[str] = []
    record.after_sent(lambda: done.append("report"))
    record.after_sent(lambda: done.append("settle"))
    assert done == []
    record.sent()
    record.sent()
    assert done == ["report", "settle"]


async def test_a_write_that_waits_does_not_hold_the_work_back() -> None:
    record = RequestRecord(_telemetry(), "req-2", "POST", "/v1/completions")
    done: list[str] = []
    record.after_sent(lambda: done.append("settle"))
    record.sending()
    assert done == []  # not before the write
    await asyncio.sleep(0)  # the write waits for its client: the loop goes on
    assert done == ["settle"]
    record.sent()  # the write ended
    assert done == ["settle"]


async def test_a_write_that_does_not_wait_runs_the_work_right_after_it_once() -> None:
    record = RequestRecord(_telemetry(), "req-3", "POST", "/v1/completions")
    done: list[str] = []
    record.after_sent(lambda: done.append("settle"))
    record.sending()
    record.sent()
    assert done == ["settle"]
    await asyncio.sleep(0)
    assert done == ["settle"]


def test_finishing_a_request_runs_what_waited_for_its_answer_first() -> None:
    telemetry = _telemetry()
    record = RequestRecord(telemetry, "req-4", "POST", "/v1/completions")
    record.worker, record.policy = "w1", "cache_aware"
    seen: list[int | None] = []

    def report() -> None:  # what the proxy leaves: the worker's cache report
        record.cache_reported(100, 60, "")
        seen.append(record.status)

    record.after_sent(report)
    telemetry.finish(record, 200, 10)
    # It ran before the request was accounted for (its status not yet set), once.
    assert seen == [0]
    assert (record.input_tokens, record.cached_tokens, record.status) == (100, 60, 200)
    telemetry.finish(record, 200, 10)
    assert seen == [0]


def test_a_long_prompts_reuse_is_counted_in_blocks_not_checkpoints() -> None:
    """Past its first 64 blocks a prompt's key has a checkpoint every few blocks. The worker
    known to hold 100 of its 150 blocks is predicted to serve 100/150 of its tokens, and the
    deepest prefix any worker held (120 blocks, from the decision) is what it could have
    served at best: a report of 1,000 cached tokens of 1,500 is then no miss."""
    telemetry = _telemetry()
    key = fingerprint("x" * (150 * 64), Namespace(), FingerprintOptions())
    assert len(key.blocks) < key.total_blocks == 150
    view = WorkerView(Worker("w1", "http://w1"))
    decision = Decision(view, "cache_aware", DecisionKind.PREFIX_HIT, match_blocks=100,
                        known_blocks=120)
    record = RequestRecord(telemetry, "req-5", "POST", "/v1/completions")
    record.decided(decision, RouteRequest(key, "m", 1600, 1500), None, time.perf_counter())
    assert (record.match_blocks, record.best_blocks, record.total_blocks) == (100, 120, 150)
    record.cache_reported(1500, 1000, "")
    telemetry.finish(record, 200, 10)
    assert telemetry.metrics.predicted_tokens.labels("w1").value == 1000
    assert record.miss_cause == ""
