"""Routers compared repeat by repeat (loadtest.paired)."""

from __future__ import annotations

import pytest

from loadtest.paired import markdown, paired, reference_router, sign_test
from loadtest.replay import RunResult


def run(router: str, repeat: int, balance: float, p99: float = 100.0,
        hit: float = 0.99) -> RunResult:
    return RunResult(
        router=router, repeat=repeat, requests=400, errors=0, block_hit_rate=hit,
        pooled_bound=1.0, hit_over_bound=hit, routed_max_over_mean=balance,
        requests_max_over_mean=1.0, prefill_max_over_mean=1.0, p50_ms=p99 / 2, p99_ms=p99,
        cpu_s_per_1k=None, seconds=1.0,
    )


def test_the_sign_test_of_a_split() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(9, 0) == pytest.approx(2 / 512)
    assert sign_test(0, 9) == pytest.approx(2 / 512)
    assert sign_test(7, 2) == pytest.approx(2 * (1 + 9 + 36) / 512)
    assert sign_test(3, 3) == 1.0


def test_a_variant_is_compared_within_each_repeat() -> None:
    """The fleets move a lot from repeat to repeat (1.2 to 1.6 here) and the variant is 0.05
    lower in each: the paired difference is -0.05 in every repeat, where the two medians are
    as far apart as the fleets' spread allows."""
    base = [1.2, 1.6, 1.3, 1.5, 1.4]
    runs = [run("ours:cache_aware", k, b, p99=300.0 + k) for k, b in enumerate(base)]
    runs += [run("ours[v]:cache_aware", k, b - 0.05, p99=(300.0 + k) * 1.1, hit=0.98)
             for k, b in enumerate(base)]
    (row,) = paired(runs)
    assert (row.router, row.reference, row.repeats) == ("ours[v]:cache_aware",
                                                        "ours:cache_aware", 5)
    assert row.routed_max_over_mean.median == pytest.approx(-0.05)
    assert (row.routed_max_over_mean.lower, row.routed_max_over_mean.higher) == (5, 0)
    assert row.routed_max_over_mean.sign_p == pytest.approx(2 / 32)
    assert row.p99_ms.median == pytest.approx(1.1)
    assert (row.p99_ms.lower, row.p99_ms.higher) == (0, 5)
    assert row.hit_over_bound.median == pytest.approx(-0.01)
    table = markdown([row])
    assert "| ours[v]:cache_aware | 5 |" in table
    assert "-0.050 (lower in 5, higher in 0; sign test 0.06)" in table
    assert "1.100x (lower in 0, higher in 5" in table


def test_only_repeats_both_ran_count_and_the_reference_is_ours() -> None:
    """A peer listed before our gateway does not become the reference; a router that shares
    fewer than two repeats with it is left out; ties count neither way."""
    runs = [run("sglang-router", 0, 2.0), run("ours:cache_aware", 0, 1.3),
            run("ours:cache_aware", 1, 1.4), run("ours:cache_aware", 2, 1.5),
            run("sglang-router", 1, 1.4), run("sglang-router", 3, 9.0),
            run("smg", 0, 1.0)]
    assert reference_router(runs) == "ours:cache_aware"
    (row,) = paired(runs)
    assert row.router == "sglang-router"
    assert row.repeats == 2
    assert row.routed_max_over_mean.median == pytest.approx(0.35)
    assert (row.routed_max_over_mean.lower, row.routed_max_over_mean.higher) == (0, 1)
    assert paired([]) == []
    assert markdown([]) == ""
