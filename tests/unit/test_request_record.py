"""A request's record: work left until its answer is sent runs once, in order, before the
request is accounted for (the worker's report of an answer feeds the miss diagnosis)."""

from __future__ import annotations

from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.record import RequestRecord, Telemetry


def _telemetry() -> Telemetry:
    return Telemetry(GatewayMetrics(WorkerPool([], PrefixIndex())))


def test_work_left_until_sent_runs_once_in_order() -> None:
    record = RequestRecord(_telemetry(), "req-1", "POST", "/v1/completions")
    done: list[str] = []
    assert not record.pending()
    record.after_sent(lambda: done.append("report"))
    record.after_sent(lambda: done.append("settle"))
    assert record.pending()
    assert done == []
    record.sent()
    record.sent()
    assert done == ["report", "settle"]
    assert not record.pending()


def test_finishing_a_request_runs_what_waited_for_its_answer_first() -> None:
    telemetry = _telemetry()
    record = RequestRecord(telemetry, "req-2", "POST", "/v1/completions")
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
    assert not record.pending()
