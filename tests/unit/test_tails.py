"""Which requests make each router's latency tail (loadtest.tails)."""

from __future__ import annotations

import pytest

from loadtest.replay import RunResult
from loadtest.tails import markdown, request_kinds, tails

# Ten requests of 10 blocks each; the first two are the run's opening (concurrency 2).
PROMPTS = [10] * 10
CONCURRENCY = 2


def run(router: str, repeat: int, latencies: list[float], cached: list[int]) -> RunResult:
    return RunResult(
        router=router, repeat=repeat, requests=len(latencies), errors=0, block_hit_rate=0.9,
        pooled_bound=1.0, hit_over_bound=0.9, routed_max_over_mean=1.0,
        requests_max_over_mean=1.0, prefill_max_over_mean=1.0, p50_ms=1.0, p99_ms=1.0,
        cpu_s_per_1k=None, seconds=1.0, latencies_ms=latencies, cached_blocks=cached,
    )


# Requests 2 and 3 are new prompts (the reference's workers reused 2 of 10 blocks); the
# others found most of theirs (8 of 10).
CACHED = [0, 0, 2, 2, 8, 8, 8, 8, 8, 8]


def test_requests_are_classed_by_what_the_reference_reused() -> None:
    runs = [run("ours:cache_aware", 0, [1.0] * 10, CACHED),
            # Another fleet where request 4 reused little and 3 a lot: the median over the
            # reference's repeats decides (ties at half count as reuse).
            run("ours:cache_aware", 1, [1.0] * 10, [0, 0, 2, 8, 0, 8, 8, 8, 8, 8]),
            run("ours:cache_aware", 2, [1.0] * 10, [0, 0, 2, 5, 4, 8, 8, 8, 8, 8]),
            # A peer's cache says nothing about the class.
            run("sglang-router", 0, [1.0] * 10, [9] * 10)]
    assert request_kinds(runs, PROMPTS, CONCURRENCY) == [
        "start", "start", "prefill", "reuse", "prefill", "reuse", "reuse", "reuse", "reuse",
        "reuse"]


def test_each_router_is_broken_down_by_class_against_the_reference() -> None:
    # Ours: the new prompts are slow (300 ms), the rest fast; the peer serves the opening
    # slower and the new prompts twice as fast, the reuses alike.
    ours = [100.0, 110.0, 300.0, 320.0, 20.0, 22.0, 24.0, 26.0, 28.0, 30.0]
    peer = [400.0, 410.0, 150.0, 160.0, 20.0, 22.0, 24.0, 26.0, 28.0, 30.0]
    runs = [run("ours:cache_aware", k, ours, CACHED) for k in range(3)]
    runs += [run("sglang-router", k, peer, [0] * 10) for k in range(3)]
    mine, theirs = tails(runs, PROMPTS, CONCURRENCY)
    assert (mine.router, mine.reference, mine.repeats) == ("ours:cache_aware",
                                                           "ours:cache_aware", 3)
    assert [k.kind for k in mine.kinds] == ["start", "prefill", "reuse"]
    assert [k.requests for k in mine.kinds] == [2, 2, 6]
    start, new, reuse = mine.kinds
    assert new.p50_ms == pytest.approx(310.0)
    assert new.ratio is None
    assert reuse.p50_ms == pytest.approx(25.0)
    # Each repeat's p99 (nearest rank of 10) is its slowest request: ours a new prompt, the
    # peer an opening request, in each of the three repeats.
    assert [k.in_tail for k in mine.kinds] == [0, 3, 0]
    assert [k.in_tail for k in theirs.kinds] == [3, 0, 0]
    start, new, reuse = theirs.kinds
    assert new.ratio == pytest.approx(0.5)
    assert reuse.ratio == pytest.approx(1.0)
    assert start.ratio == pytest.approx((400 / 100 + 410 / 110) / 2)
    table = markdown([mine, theirs])
    assert "start 2, prefill 2, reuse 6" in table
    assert "| sglang-router | 405.0 / 410.0, 3.86x | 155.0 / 160.0, 0.50x |" in table
    assert table.rstrip().endswith("| 3 / 0 / 0 |")


def test_runs_that_do_not_cover_the_trace_are_left_out() -> None:
    assert tails([], PROMPTS, CONCURRENCY) == []
    runs = [run("ours:cache_aware", 0, [1.0] * 10, CACHED),
            run("smg", 0, [1.0] * 9, [0] * 9)]  # a run cut short
    (only,) = tails(runs, PROMPTS, CONCURRENCY)
    assert only.router == "ours:cache_aware"
    assert markdown([]) == ""


def test_without_the_reference_s_reuse_every_later_request_counts_as_reuse() -> None:
    runs = [run("sglang-router", 0, [1.0] * 10, [])]
    assert request_kinds(runs, PROMPTS, CONCURRENCY) == ["start"] * 2 + ["reuse"] * 8
