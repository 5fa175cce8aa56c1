"""The replay's reading of our gateway's event-loop lag: the histogram the gateway exports,
read twice, gives the run's own samples."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.telemetry.metrics import GatewayMetrics
from loadtest.gateway_lag import LagReading, between, parse


def page(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_two_reads_of_the_gateways_own_page_give_the_samples_between_them() -> None:
    metrics = GatewayMetrics(WorkerPool([], PrefixIndex()))
    metrics.loop_lag.observe(0.0005)  # at start-up: not the run's
    before = parse(page(metrics))
    for lag in (0.002, 0.004, 0.030, 0.500):
        metrics.loop_lag.observe(lag)
    after = parse(page(metrics))
    assert before == LagReading(1.0, 0.0005, 1.0)
    assert after is not None
    assert after.count == 5.0
    mean_ms, over = between(before, after)
    assert mean_ms is not None
    assert abs(mean_ms - 134.0) < 1e-6  # (2 + 4 + 30 + 500) / 4
    assert over == 0.5  # 30 ms and 500 ms


def test_no_reading_or_no_sample_between_gives_none() -> None:
    metrics = GatewayMetrics(WorkerPool([], PrefixIndex()))
    reading = parse(page(metrics))
    assert reading == LagReading(0.0, 0.0, 0.0)
    assert between(reading, reading) == (None, None)
    assert between(None, reading) == (None, None)
    assert parse("# a page without the histogram\nother_metric 1\n") is None
