"""The scale benchmark: recovery and medians on made-up samples, its modes, its client."""

from __future__ import annotations

import gc

from loadtest.bench_scale import (
    MEDIAN_FIELDS,
    MODES,
    PEERS_TOKEN,
    ModeResult,
    Sample,
    ScaleConfig,
    collector_paused,
    median_summaries,
    mode_gateway_args,
    mode_worker_args,
    recovery_s,
    recovery_vs_s,
    repeat_config,
)


def _run(mode: str, hits: list[float], start: float = -20.0) -> ModeResult:
    """One sample per second from ``start``; ``hits[i]`` is that second's hit rate."""
    result = ModeResult(mode)
    for i, hit in enumerate(hits):
        result.samples.append(Sample(t=start + i, ttft_s=0.01, ok=True, input_tokens=1000,
                                     matched_tokens=round(1000 * hit), worker="w"))
    return result


def test_a_drift_of_the_load_itself_is_no_slow_recovery_against_the_control() -> None:
    # Both runs drift from 0.90 to 0.88 over the minute; the scaled one also dips at the change.
    drift = [0.90] * 20 + [0.90 - 0.02 * i / 60 for i in range(60)]
    scaled = drift[:20] + [h - 0.05 if i < 5 else h for i, h in enumerate(drift[20:])]
    control, run = _run("control", drift), _run("warmup", scaled)
    assert recovery_s(run, 0.90, 60.0) is None  # never back within 1 pt of the steady level
    # 10 s windows: the one from 2 s still holds 3 dipped seconds (1.5 pt below), from 3 s 2.
    assert recovery_vs_s(run, control, 60.0) == 12.0


def test_no_dip_is_zero_and_a_dip_to_the_end_is_never() -> None:
    flat = _run("control", [0.9] * 80)
    assert recovery_vs_s(_run("cold", [0.9] * 80), flat, 60.0) == 0.0
    assert recovery_vs_s(_run("cold", [0.9] * 20 + [0.8] * 60), flat, 60.0) is None


def test_each_mode_starts_its_gateway_with_its_own_flags() -> None:
    sample = ("--warmup-sample", "*")
    assert mode_gateway_args("cold") == (*sample, "--no-warmup")
    assert mode_gateway_args("noprewarm") == (*sample, "--no-prewarm")
    assert mode_gateway_args("warmup") == mode_gateway_args("control") == sample
    # peers: nothing sampled; the gateway holds the token the workers' exports answer to
    assert mode_gateway_args("peers") == ("--worker-admin-token", PEERS_TOKEN)
    assert mode_worker_args("peers") == ("--admin-token", PEERS_TOKEN)
    assert mode_worker_args("warmup") == mode_worker_args("cold") == ()
    assert set(MODES) == {"warmup", "cold", "noprewarm", "peers", "control"}


def test_repeats_give_each_modes_medians_and_every_failure() -> None:
    def summary(mode: str, ratio: float, failed: int) -> dict[str, object]:
        row: dict[str, object] = {name: ratio for name in MEDIAN_FIELDS}
        return row | {"mode": mode, "failed": failed, "requests": 100}

    runs = [[summary("warmup", r, f), summary("control", 2 * r, 0)]
            for r, f in ((1.3, 0), (1.1, 2), (1.2, 1))]
    medians = median_summaries(runs)
    assert [m["mode"] for m in medians] == ["warmup", "control"]
    warm, control = medians
    assert warm["p99_ratio"] == 1.2
    assert control["p99_ratio"] == 2.4
    assert warm["p99_ratios"] == [1.3, 1.1, 1.2]
    assert (warm["failed"], warm["requests"], control["failed"]) == (3, 300, 0)


def test_the_client_collects_no_garbage_while_the_load_runs() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what was built before the load is never walked
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_each_repeat_draws_another_load_and_every_mode_of_it_the_same() -> None:
    config = ScaleConfig(seed=7, repeats=3)
    assert [repeat_config(config, i).seed for i in range(3)] == [7, 8, 9]
    assert repeat_config(config, 0) == config
