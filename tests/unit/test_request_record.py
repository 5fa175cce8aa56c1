"""A request's record: work left until its answer is sent runs once, in order, right after
the write (or at the event loop's next pass while a write waits for a slow client), and
before the request is accounted for (the worker's report of an answer feeds the miss
diagnosis)."""

from __future__ import annotations

import asyncio

from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
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
