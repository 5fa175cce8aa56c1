"""The what-if summary: workloads named from a report's options, pairs summed per workload."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.replay import build_parser
from loadtest.whatif import Pair, markdown, summarize, workload_label


def test_a_workload_is_named_by_its_trace_window_and_fleet() -> None:
    args = build_parser().parse_args([
        "--workload", "agent-sessions", "--skip", "2000", "--limit", "400", "--workers", "16",
        "--cache-blocks", "2000", "--repeat", "3", "--peers", "--json"])
    assert workload_label(args) == "agent-sessions, skip 2000, 400 requests, 16 x 2000"
    args = build_parser().parse_args(
        ["--workers", "16", "--cache-blocks", "500", "--no-report-cache-size"])
    assert workload_label(args) == "Mooncake, 16 x 500, size not reported"


def _pair(workload: str, base: float, changed: float, decided: float | None = 0.0) -> Pair:
    return Pair(workload, "ours:cache_aware", (0.9, 1.1), (base, 1.2), (changed, 1.3),
                decided, None if decided is None else decided + changed - base)


def test_pairs_are_summed_per_workload_in_the_order_seen() -> None:
    rows = summarize([_pair("b", 0.90, 0.92), _pair("a", 0.80, 0.79),
                      _pair("b", 0.94, 0.94), _pair("b", 0.96, 0.99)])
    assert [r["workload"] for r in rows] == ["b", "a"]
    b, a = rows
    assert b["runs"] == 3
    assert b["hit_change"] == pytest.approx((0.02 + 0.0 + 0.03) / 3)
    assert (b["runs_raised"], b["runs_lowered"]) == (2, 0)
    assert b["simulated"] == pytest.approx([(0.90 + 0.94 + 0.96) / 3, 1.2])
    assert b["changed"] == pytest.approx([(0.92 + 0.94 + 0.99) / 3, 1.3])
    assert b["balance_change"] == pytest.approx(0.1)
    assert b["hit_change_decided"] == pytest.approx(b["hit_change"])
    assert (a["runs_raised"], a["runs_lowered"]) == (0, 1)


def test_no_decision_instant_change_when_a_run_lacks_them() -> None:
    (row,) = summarize([_pair("w", 0.9, 0.91), _pair("w", 0.9, 0.92, decided=None)])
    assert row["hit_change_decided"] is None


def test_the_simulated_p99_change_is_paired_run_by_run() -> None:
    pairs = [dataclasses.replace(_pair("w", 0.9, 0.9), base_p99=base, changed_p99=changed)
             for base, changed in [(300.0, 330.0), (280.0, 270.0), (310.0, 340.0)]]
    (row,) = summarize(pairs)
    assert row["p99_change_ms"] == pytest.approx((30.0 - 10.0 + 30.0) / 3)
    assert (row["runs_p99_higher"], row["runs_p99_lower"]) == (2, 1)
    text = markdown([row], "policy.x=1", 1)
    assert "| +16.7 (2, 1) |" in text
