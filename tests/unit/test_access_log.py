"""The access log's stdout sink: lines written in batches, none lost, none reordered."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.telemetry.access_log import (
    FLUSH_LINES,
    LOGGER_NAME,
    AccessLog,
    BufferedLines,
    configure_stream,
)
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.record import RequestRecord, Telemetry


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    logger = logging.getLogger(LOGGER_NAME)
    saved = logger.handlers[:], logger.propagate, logger.level
    out = io.StringIO()
    configure_stream(out)
    yield out
    logger.handlers, logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


def test_without_an_event_loop_each_line_is_written_at_once() -> None:
    out = io.StringIO()
    sink = BufferedLines(out)
    sink.write_line("one")
    assert out.getvalue() == "one\n"
    sink.write_line("two")
    assert out.getvalue() == "one\ntwo\n"


async def test_inside_the_loop_lines_wait_for_the_timer_and_keep_their_order() -> None:
    out = io.StringIO()
    sink = BufferedLines(out)
    for i in range(5):
        sink.write_line(f"line {i}")
    assert out.getvalue() == ""  # batched: no write per line
    for _ in range(100):
        if out.getvalue():
            break
        await asyncio.sleep(0.05)
    assert out.getvalue().splitlines() == [f"line {i}" for i in range(5)]


async def test_a_full_batch_is_written_without_waiting() -> None:
    out = io.StringIO()
    sink = BufferedLines(out)
    for i in range(FLUSH_LINES):
        sink.write_line(str(i))
    assert out.getvalue().splitlines() == [str(i) for i in range(FLUSH_LINES)]


async def test_flush_writes_what_is_left() -> None:
    out = io.StringIO()
    sink = BufferedLines(out)
    sink.write_line("pending")  # batched: its timer is still due
    assert out.getvalue() == ""
    sink.flush()
    assert out.getvalue() == "pending\n"
    sink.flush()
    assert out.getvalue() == "pending\n"


async def test_access_lines_reach_the_configured_stream_as_json(stream: io.StringIO) -> None:
    telemetry = Telemetry(GatewayMetrics(WorkerPool([], PrefixIndex())),
                          access_log=AccessLog("json"))
    record = RequestRecord(telemetry, "req-1", "POST", "/v1/chat/completions")
    record.model, record.tenant = "m", "t" * 24
    telemetry.finish(record, 200, 17)
    telemetry.finish(RequestRecord(telemetry, "req-2", "POST", "/v1/completions"), 400, 3)
    logging.getLogger(LOGGER_NAME).handlers[0].flush()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["request_id"], x["status"], x["bytes"]) for x in lines] == [
        ("req-1", 200, 17), ("req-2", 400, 3)]
    assert lines[0]["model"] == "m"
    assert lines[0]["tenant"] == "t" * 16
