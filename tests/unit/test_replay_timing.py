"""How the live replay turns a run's measurements into the simulator's timing."""

from __future__ import annotations

import pytest

from loadtest.replay import ReplayConfig, RunResult
from loadtest.replay_sim import delay_factors, live_timing, simulated
from loadtest.traces import TraceRequest, prefix_key


def run(requests: int, seconds: float, latency_ms: float, inflight: float | None) -> RunResult:
    return RunResult(
        router="ours:cache_aware", repeat=0, requests=requests, errors=0, block_hit_rate=0.5,
        pooled_bound=0.6, hit_over_bound=0.8, routed_max_over_mean=1.0,
        requests_max_over_mean=1.0, prefill_max_over_mean=1.0, p50_ms=latency_ms,
        p99_ms=latency_ms, cpu_s_per_1k=None, seconds=seconds, mean_latency_ms=latency_ms,
        gateway_inflight=inflight,
    )


def test_the_gateway_holds_its_share_of_the_latency() -> None:
    config = ReplayConfig(workers=4, cache_blocks=100, concurrency=32)
    # 100 requests/s at 320 ms: 32 in flight at the client, 24 of them decided by the gateway.
    route, relay = live_timing(run(1000, 10.0, 320.0, 24.0), config)
    assert (route, relay) == pytest.approx((0.08, 0.24))
    # No sample: the gateway holds the whole latency.
    assert live_timing(run(1000, 10.0, 320.0, None), config) == pytest.approx((0.0, 0.32))
    assert live_timing(run(0, 0.0, 0.0, None), config) == (0.0, 0.0)


def test_each_request_keeps_its_live_latency() -> None:
    measured = run(3, 1.0, 200.0, None)
    measured.latencies_ms = [100.0, 200.0, 300.0]
    assert delay_factors(measured) == pytest.approx((0.5, 1.0, 1.5))
    assert delay_factors(run(3, 1.0, 200.0, None)) == ()


def test_simulated_balance_counts_blocks_as_the_live_run_does() -> None:
    # Round-robin over two workers: 10-block prompts all on one, 1-block ones on the other.
    reqs = [TraceRequest(i, 0.0, 512 * n, 1, prefix_key(range(100 * i, 100 * i + n), 512 * n))
            for i, n in enumerate([10, 1, 10, 1])]
    sim = simulated(reqs, ReplayConfig(workers=2, cache_blocks=50, concurrency=1),
                    "round_robin", pooled=1.0)
    assert sim["routed_max_over_mean"] == pytest.approx(20 / 11)
    assert sim["requests_max_over_mean"] == 1.0
