"""The pre-warming benchmark's load: a seeded surge of one shared prompt over a base load."""

from __future__ import annotations

from loadtest.bench_prewarm import SurgeConfig, arrivals, medians, parse_args, surge_rate

CONFIG = SurgeConfig(base_rate=4.0, surge_from=2.0, surge_to=20.0, before_s=10.0, ramp_s=20.0,
                     hold_s=10.0, system_chars=3000, seed=3)


def test_the_surge_climbs_from_its_start_to_its_peak_and_holds() -> None:
    assert surge_rate(CONFIG, 5.0) == 0.0  # before the surge: the base load alone
    assert surge_rate(CONFIG, 10.0) == 2.0
    assert surge_rate(CONFIG, 20.0) == 11.0  # half-way up the ramp
    assert surge_rate(CONFIG, 35.0) == 20.0
    assert surge_rate(CONFIG, 40.0) == 0.0  # over


def test_arrivals_are_seeded_and_follow_the_rates() -> None:
    load = arrivals(CONFIG)
    assert load == arrivals(CONFIG)
    assert [a.at for a in load] == sorted(a.at for a in load)
    surge = [a for a in load if a.surge]
    # One prompt shared by every surge request, each with a question of its own.
    assert len({a.body["messages"][0]["content"] for a in surge}) == 1
    assert len({a.body["messages"][1]["content"] for a in surge}) > len(surge) * 0.9
    assert not any(a.at < CONFIG.before_s for a in surge)
    # Expected counts: the ramp averages 11 req/s over 20 s, then 20 req/s for 10 s; the base
    # load 4 req/s over 40 s. Poisson spread of a few percent.
    assert 380 <= len(surge) <= 460
    assert 130 <= len(load) - len(surge) <= 190
    ramp_end = [a for a in surge if 25.0 <= a.at < 30.0]
    ramp_start = [a for a in surge if 10.0 <= a.at < 15.0]
    assert len(ramp_end) > 2 * len(ramp_start)


def test_medians_per_mode_sum_failures_and_skip_empty_kinds() -> None:
    def row(mode: str, p99: float, cold_p50: float, failed: int) -> dict[str, object]:
        return {"mode": mode, "surge_requests": 10, "failed": failed, "surge_ttft_p50_ms": 1.0,
                "surge_ttft_p99_ms": p99, "surge_cold": 1, "surge_cold_ttft_p50_ms": cold_p50,
                "surge_workers": 2, "base_ttft_p99_ms": 1.0, "prewarms_sent": 0,
                "prewarms_placed": 0}

    runs = [[row("prewarm", 100.0, float("nan"), 0)], [row("prewarm", 300.0, 50.0, 1)],
            [row("prewarm", 200.0, 70.0, 2)]]
    (merged,) = medians(runs)
    assert merged["surge_ttft_p99_ms"] == 200.0
    assert merged["surge_cold_ttft_p50_ms"] == 60.0  # the repeat without a cold request is left out
    assert (merged["failed"], merged["surge_requests"]) == (3, 30)


def test_a_gateway_from_another_checkout_is_one_more_mode() -> None:
    config, _ = parse_args(["--modes", "prewarm", "--gateway-from", "before=/src/old"])
    assert config.modes == ("prewarm", "before")
    assert config.sources == (("before", "/src/old"),)


def test_the_surge_alone_without_a_base_load() -> None:
    load = arrivals(SurgeConfig(base_rate=0.0, surge_to=10.0, before_s=1.0, ramp_s=2.0,
                                hold_s=2.0, system_chars=500))
    assert load
    assert all(a.surge for a in load)
