"""The cluster simulator, on small traces with answers computed by hand."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gateway.contracts.engine_metrics import (
    FIRST_TOKEN_TIME_COUNT,
    FIRST_TOKEN_TIME_SUM,
    QUEUE_TIME_COUNT,
)
from gateway.fingerprint import Namespace, fingerprint
from gateway.rebalance import Shed
from gateway.routing.policies import POLICY_NAMES, PolicyOptions
from gateway.routing.ring import Ring
from gateway.session import Attempt
from loadtest import simulate as cli
from loadtest.sim import (
    ORACLE,
    ClusterSim,
    SimConfig,
    SimResult,
    gateway_key,
    metrics,
    policy_names,
    pooled_bound,
    simulate,
    worker_ids,
)
from loadtest.traces import (
    SyntheticSpec,
    TraceRequest,
    prefix_key,
    synthetic_trace,
    to_mooncake_lines,
)
from worker.engines.sim import SimCosts

FREE = SimCosts(prefill_us_per_token=0.0, prefill_us_per_cached_token=0.0,
                decode_ms_per_token=0.0)


def trace(*prompts: list[int], tokens: int | None = None, output: int = 1,
          gap_s: float = 0.0) -> list[TraceRequest]:
    """Requests with the given block ids (input = whole blocks unless ``tokens``)."""
    out = []
    for i, ids in enumerate(prompts):
        n = tokens if tokens is not None else 512 * len(ids)
        out.append(TraceRequest(i, i * gap_s, n, output, prefix_key(ids, n)))
    return out


def config(workers: int, blocks: int, policy: str, **changes: Any) -> SimConfig:
    """One request at a time, free costs, unless ``changes`` say otherwise."""
    base = SimConfig(workers, blocks, policy, concurrency=1, costs=FREE)
    return dataclasses.replace(base, **changes)


def num(m: Mapping[str, object], key: str) -> float:
    value = m[key]
    assert isinstance(value, int | float)
    return float(value)


# One worker, 4 blocks, one request at a time. LRU, deepest block evicted first:
#   [1,2] miss -> [3,4] miss (free blocks) -> [1,2] hit 2 -> [5,6] miss (evicts 4, 3)
#   -> [3,4] miss (evicts 2, 1) -> [5,6,7] hit 2 (evicts 4) -> [1,2] miss.
LRU_SEQUENCE = ([1, 2], [3, 4], [1, 2], [5, 6], [3, 4], [5, 6, 7], [1, 2])
LRU_HITS = 4 / 15


@pytest.mark.parametrize("policy", [*POLICY_NAMES, ORACLE])
def test_one_worker_known_lru_evictions(policy: str) -> None:
    result = simulate(trace(*LRU_SEQUENCE), config(1, 4, policy))
    assert (result.matched_blocks, result.blocks) == (4, 15)
    m = metrics(result, pooled_bound(trace(*LRU_SEQUENCE), 4))
    assert m["block_hit_rate"] == pytest.approx(LRU_HITS)
    assert m["hit_over_bound"] == pytest.approx(1.0)
    assert result.per_worker[0].uncached_blocks == 11


def test_loss_breakdown_splits_the_gap_to_the_pooled_lru() -> None:
    # Round robin, two workers with room for everything: [1,2,3] on w0, [1,2,3,4] on w1 (w0
    # held 3 of it: routed elsewhere), [1,2,3,4,5] on w0 (w1 held 4, w0 reuses 3: 1 more).
    reqs = trace([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5])
    result = simulate(reqs, config(2, 100, "round_robin", loss_breakdown=True))
    assert result.losses == {"routed_elsewhere": 3 + 1, "evicted_fleet_wide": 0, "kept_longer": 0}
    pooled = pooled_bound(reqs, 200)
    m = metrics(result, pooled)
    losses = m["losses"]
    assert isinstance(losses, dict)
    # The pooled LRU's hit rate, less what was routed elsewhere, is what the fleet reused.
    assert pooled - losses["routed_elsewhere"] == pytest.approx(num(m, "block_hit_rate"), abs=1e-4)
    # One worker is its own pooled LRU: nothing is lost, whatever it evicts.
    one = simulate(trace(*LRU_SEQUENCE), config(1, 4, "round_robin", loss_breakdown=True))
    assert one.losses == {"routed_elsewhere": 0, "evicted_fleet_wide": 0, "kept_longer": 0}
    assert simulate(reqs, config(2, 100, "round_robin")).losses == {}


def test_pooled_bound_is_one_lru_of_all_capacity() -> None:
    reqs = trace(*LRU_SEQUENCE)
    assert pooled_bound(reqs, 4) == pytest.approx(LRU_HITS)
    # Room for everything: [1,2] twice, [3,4] once and [5,6] of [5,6,7] are reused.
    assert pooled_bound(reqs, 100) == pytest.approx((2 + 2 + 2 + 2) / 15)
    assert pooled_bound([], 4) == 0.0


def test_two_workers_consistent_hash_follows_the_ring() -> None:
    convs = [[10 * c + i for i in range(4)] for c in range(12)]
    reqs = trace(*convs, *[[*ids, 999 + j] for j, ids in enumerate(convs)])
    result = simulate(reqs, config(2, 1000, "consistent_hash"))
    ring = Ring(dict.fromkeys(worker_ids(2), 1.0))
    assert list(result.assignments) == [ring.owner(r.key.anchor) for r in reqs]
    assert len(set(result.assignments)) == 2  # both workers own some anchors
    # Each follow-up lands where its conversation started and reuses its 4 blocks.
    assert result.matched_blocks == 12 * 4
    assert result.blocks == 12 * 4 + 12 * 5


def test_round_robin_spreads_exactly_evenly() -> None:
    reqs = trace(*[[i, i + 1000] for i in range(30)])
    result = simulate(reqs, config(3, 50, "round_robin", concurrency=8))
    assert [w.routed for w in result.per_worker] == [10, 10, 10]
    assert metrics(result, 0.0)["routed_max_over_mean"] == 1.0


def test_oracle_beats_round_robin_on_shared_prefixes() -> None:
    for seed in (1, 2, 3):
        reqs = synthetic_trace(SyntheticSpec(requests=400, tenants=8, system_blocks=6, seed=seed))
        bound = pooled_bound(reqs, 4 * 128)
        rr = simulate(reqs, SimConfig(4, 128, "round_robin", concurrency=8))
        oracle = simulate(reqs, SimConfig(4, 128, ORACLE, concurrency=8))
        assert rr.matched_blocks < oracle.matched_blocks <= bound * oracle.blocks


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_runs_and_reports(policy: str) -> None:
    reqs = synthetic_trace(SyntheticSpec(requests=200, tenants=6, seed=1))
    result = simulate(reqs, SimConfig(4, 80, policy, concurrency=16))
    m = metrics(result, pooled_bound(reqs, 320))
    assert m["requests"] == 200
    assert sum(w.routed for w in result.per_worker) == 200
    assert len(result.decision_us) == len(result.ttft_s) == 200
    assert 0.0 <= num(m, "block_hit_rate") <= 1.0
    assert num(m, "ttft_p50") > 0.0
    per_worker = m["per_worker"]
    assert isinstance(per_worker, dict)
    assert set(per_worker) == set(worker_ids(4))


def test_cost_model_prefill_of_uncached_and_cached_tokens() -> None:
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=2.5,
                     decode_ms_per_token=10.0)
    reqs = trace([1, 2], [1, 2], tokens=1000, output=3)
    result = simulate(reqs, config(1, 8, "round_robin", costs=costs))
    # Cold: 1000 uncached tokens. Warm: both blocks cached, capped at the 1000 real tokens.
    assert result.ttft_s == pytest.approx((0.1, 0.0025))
    # Sequential, one in flight: the second starts when the first ends (2 decode steps).
    assert result.sim_seconds == pytest.approx(0.1 + 0.02 + 0.0025 + 0.02)


def test_a_matched_block_saves_the_units_own_block_of_tokens() -> None:
    """Units of 16 tokens a block (the live replay's): a request that matches one of its four
    blocks prefills the other 48 tokens, not none (one block taken as the traces' 512 tokens
    covered the whole prompt)."""
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = trace([1, 2, 3, 4], [1, 5, 6, 7], tokens=64)
    small = simulate(reqs, config(1, 16, "round_robin", costs=costs, block_tokens=16))
    assert small.matched_blocks == 1
    assert small.ttft_s == pytest.approx((64 * 1e-4, 48 * 1e-4))
    # The traces' own blocks: one matched block is 512 tokens, more than the prompt.
    traces = simulate(reqs, config(1, 16, "round_robin", costs=costs))
    assert traces.ttft_s == pytest.approx((64 * 1e-4, 0.0))


def test_replay_serializes_prefill_per_worker() -> None:
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = trace([1], [2], [3], tokens=500)  # all arrive at t=0
    serial = simulate(reqs, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                   costs=costs))
    assert serial.ttft_s == pytest.approx((0.05, 0.10, 0.15))
    parallel = simulate(reqs, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                     costs=costs, serial_prefill=False))
    assert parallel.ttft_s == pytest.approx((0.05, 0.05, 0.05))
    # Arrival times divided by the speedup.
    spaced = trace([1], [2], tokens=500, gap_s=1.0)
    fast = simulate(spaced, config(1, 8, "round_robin", mode="replay", speedup=4.0,
                                   costs=costs))
    assert fast.sim_seconds == pytest.approx(0.25 + 0.05)


def test_shared_prefill_compute_splits_the_engine_between_the_prefills() -> None:
    """With the worker's ``prefill_shared`` the prefills in progress share one engine (its
    own processor-sharing bookkeeping), so prefills started together end together, and one
    that starts later slows the others from then on: neither the serial nor the parallel
    model gives these instants."""
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0, prefill_shared=True)
    together = trace([1], [2], tokens=500)  # 0.05 s of prefill each, both at t=0
    shared = simulate(together, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                       costs=costs))
    assert shared.ttft_s == pytest.approx((0.10, 0.10))
    # The second arrives at 0.02 s: the first has 0.03 s of work left, done at half speed by
    # 0.08 s; the second then has 0.02 s of its 0.05 s left, alone: done at 0.10 s.
    later = trace([1], [2], tokens=500, gap_s=0.02)
    shared = simulate(later, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                    costs=costs))
    assert shared.ttft_s == pytest.approx((0.08, 0.08))  # from each one's own arrival
    assert shared.sim_seconds == pytest.approx(0.10)
    # Whatever serial_prefill says: the costs are the engine's own.
    serial = simulate(later, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                    costs=costs, serial_prefill=True))
    assert serial.ttft_s == shared.ttft_s
    # On two workers each prefill has an engine to itself.
    apart = simulate(together, config(2, 8, "round_robin", mode="replay", concurrency=None,
                                      costs=costs))
    assert apart.ttft_s == pytest.approx((0.05, 0.05))


def test_shared_prefill_metrics_count_first_tokens_when_they_come() -> None:
    """The engine's time-to-first-token histogram counts a request when its prefill ends;
    the admission-wait histogram when it is admitted."""
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0, prefill_shared=True)
    sim = ClusterSim(config(1, 8, "round_robin", mode="replay", concurrency=None,
                            costs=costs, probe_interval_s=0.0))
    sim.run(trace([1], [2], tokens=500))
    (worker,) = sim.workers.values()
    metrics = worker.metrics()
    assert metrics[FIRST_TOKEN_TIME_COUNT] == 2
    assert metrics[FIRST_TOKEN_TIME_SUM] == pytest.approx(0.20)
    assert metrics[QUEUE_TIME_COUNT] == 2


def test_requests_wait_for_blocks_held_by_running_ones() -> None:
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    # 3 blocks: the second request (3 blocks) cannot be admitted until the first ends.
    reqs = trace([1, 2], [3, 4, 5], tokens=1000)
    result = simulate(reqs, config(1, 3, "round_robin", mode="replay", concurrency=None,
                                   costs=costs))
    assert result.ttft_s == pytest.approx((0.1, 0.2))


def test_when_engines_let_others_reuse_a_prefix_in_prefill() -> None:
    # Two requests for one prompt, sent together to one worker, and a third sent later. An
    # engine that reuses a block from its admission on serves the second from the first's
    # blocks at once; one that reuses it once scheduled (vLLM) serves it too, its first token
    # once the first computed them; one that reuses it only once computed computes it again.
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = [*trace([1, 2], [1, 2], tokens=1000),
            TraceRequest(2, 1.0, 1000, 1, prefix_key([1, 2], 1000))]
    for reuse, reused, ttft in (("admitted", (0, 2, 2), (0.1, 0.0, 0.0)),
                                ("scheduled", (0, 2, 2), (0.1, 0.1, 0.0)),
                                ("computed", (0, 0, 2), (0.1, 0.1, 0.0))):
        result = simulate(reqs, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                       costs=costs, serial_prefill=False, reuse=reuse))
        assert result.reused == reused, reuse
        assert result.ttft_s == pytest.approx(ttft), reuse


def test_on_shared_compute_a_reuser_waits_for_the_prefill_it_reuses() -> None:
    # Shared compute, vLLM's rule: request 1 (2 blocks) reuses the block request 0 (1 block,
    # 0.1 s alone) began, and computes its own block beside it (0.1 s alone): both progress
    # at half speed and end at 0.2 s. A request 2 with request 0's block and a long suffix
    # (0.3 s alone) ends after it: reused blocks never hold a first token back by themselves.
    costs = SimCosts(prefill_us_per_token=1e5 / 512, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0, prefill_shared=True)  # 0.1 s a 512-token block
    reqs = trace([1], [1, 2])
    result = simulate(reqs, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                   costs=costs, serial_prefill=False, reuse="scheduled"))
    assert result.reused == (0, 1)
    assert result.ttft_s == pytest.approx((0.2, 0.2))
    late = trace([1], [1, 2, 3, 4])
    result = simulate(late, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                   costs=costs, serial_prefill=False, reuse="scheduled"))
    assert result.reused == (0, 1)
    assert result.ttft_s == pytest.approx((0.2, 0.4))


def test_a_request_waits_for_the_answer_it_follows_holding_its_slot() -> None:
    # Two slots; request 1 follows request 0 (a session's next turn), request 2 is another
    # session's. Request 1's sender waits for request 0's answer, so request 2 waits for a
    # slot too: both go once request 0 is answered, and request 1 finds its blocks.
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = trace([1, 2], [1, 2, 3], [7, 8], tokens=1000)
    together = simulate(reqs, config(1, 8, "round_robin", concurrency=2, costs=costs,
                                     serial_prefill=False, reuse="computed"))
    assert together.reused == (0, 0, 0)
    waited = simulate(reqs, config(1, 8, "round_robin", concurrency=2, costs=costs,
                                   serial_prefill=False, reuse="computed",
                                   after=(-1, 0, -1)))
    assert waited.reused == (0, 2, 0)
    # Request 1 has nothing left to prefill; request 2 starts at 0.1, when a slot frees.
    assert sorted(waited.ttft_s) == pytest.approx([0.0, 0.1, 0.1])
    assert waited.sim_seconds == pytest.approx(0.2)


def test_a_request_following_an_answer_waits_its_think_time_too() -> None:
    # Request 1 follows request 0 (answered at 0.1 s) and thinks 0.05 s more, holding its
    # slot: with one slot, request 2 goes only after request 1.
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = trace([1, 2], [1, 2, 3], [7, 8], tokens=1000)
    result = simulate(reqs, config(1, 8, "round_robin", concurrency=1, costs=costs,
                                   serial_prefill=False, reuse="computed", after=(-1, 0, -1),
                                   think_s=(0.0, 0.05, 0.0)))
    assert result.reused == (0, 2, 0)
    # 0.1 for request 0, 0.05 thinking, request 1 all cached, 0.1 for request 2 (0.2 without).
    assert result.sim_seconds == pytest.approx(0.25)


def test_at_given_instants_a_request_still_waits_for_the_answer_it_follows() -> None:
    # Arrivals at fixed instants (a live run's decisions): request 1 is due at 0.05 s, before
    # request 0's answer at 0.1 s. Following it, it goes at 0.1 s and finds its history
    # computed; without, it computes it again beside request 0.
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = [TraceRequest(0, 0.0, 1000, 1, prefix_key([1, 2], 1000)),
            TraceRequest(1, 0.05, 1500, 1, prefix_key([1, 2, 3], 1500))]
    for after, reused in (((), (0, 0)), ((-1, 0), (0, 2))):
        result = simulate(reqs, config(1, 8, "round_robin", mode="replay", concurrency=None,
                                       costs=costs, serial_prefill=False,
                                       reuse="computed", after=after))
        assert result.reused == reused, after


def test_cli_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [(i * 0.5, 1024, 4, [0, 1 + i % 3]) for i in range(12)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(to_mooncake_lines(rows)) + "\n", encoding="utf-8")
    assert cli.main(["--trace", str(path), "--workers", "2", "--cache-blocks", "8",
                     "--policy", "round_robin", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("block_hit_rate", "pooled_bound", "hit_over_bound", "prefill_max_over_mean",
                "routed_max_over_mean", "ttft_p50", "ttft_p99", "decision_us_p50",
                "decision_us_p99", "requests", "workers", "cache_blocks", "policy",
                "per_worker"):
        assert key in out
    assert out["requests"] == 12
    assert out["mode"] == "sequential"
    assert out["concurrency"] == 64
    assert cli.main(["--trace", str(path), "--workers", "2", "--cache-blocks", "8",
                     "--policy", "all", "--speedup", "2"]) == 0
    table = capsys.readouterr().out
    assert "replay, speedup 2.0" in table
    for name in policy_names():
        assert f"| {name} |" in table


def test_cli_prefill_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Four 1,000-token prompts at once on one worker, 0.1 s of prefill each: one after the
    # other (the default), side by side, or sharing the engine.
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(to_mooncake_lines([(0.0, 1000, 1, [i]) for i in range(4)]))
                    + "\n", encoding="utf-8")
    base = ["--trace", str(path), "--workers", "1", "--cache-blocks", "8", "--policy",
            "round_robin", "--mode", "replay", "--prefill-us-per-token", "100",
            "--decode-ms-per-token", "0", "--json"]
    p50 = {}
    for flag in ("", "--parallel-prefill", "--prefill-shared"):
        assert cli.main([*base, *([flag] if flag else [])]) == 0
        p50[flag] = json.loads(capsys.readouterr().out)["ttft_p50"]
    assert p50[""] == pytest.approx(0.2)  # the nearest-rank median of 0.1, 0.2, 0.3, 0.4
    assert p50["--parallel-prefill"] == pytest.approx(0.1)
    assert p50["--prefill-shared"] == pytest.approx(0.4)  # all four end together


def test_ring_seeds_name_other_fleets() -> None:
    assert worker_ids(3) == ["w0", "w1", "w2"]
    assert worker_ids(3, ring_seed=2) == ["s2-w0", "s2-w1", "s2-w2"]
    seeded = Ring(dict.fromkeys(worker_ids(16, 5), 1.0))
    plain = Ring(dict.fromkeys(worker_ids(16), 1.0))
    anchors = range(0, 2**63, 2**57)
    plain_numbers = [str(plain.owner(a)).removeprefix("w") for a in anchors]
    seeded_numbers = [str(seeded.owner(a)).removeprefix("s5-w") for a in anchors]
    # Another seed is another ring: the same anchors go to other worker numbers.
    assert sum(p != s for p, s in zip(plain_numbers, seeded_numbers, strict=True)) > 16


def test_cli_ring_seeds_summarise_mean_min_max(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [(i * 0.5, 1024, 4, [0, 1 + i % 5, 100 + i]) for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(to_mooncake_lines(rows)) + "\n", encoding="utf-8")
    argv = ["--trace", str(path), "--workers", "3", "--cache-blocks", "8",
            "--policy", "consistent_hash", "--ring-seeds", "0", "1", "2"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = out["results"]
    assert [r["ring_seed"] for r in runs] == [0, 1, 2]
    (summary,) = out["summary"]
    assert summary["seeds"] == [0, 1, 2]
    for key in ("hit_over_bound", "routed_max_over_mean"):
        values = [r[key] for r in runs]
        assert summary[key]["mean"] == pytest.approx(sum(values) / 3)
        assert summary[key]["min"] == min(values)
        assert summary[key]["max"] == max(values)
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "over ring seeds 0 1 2" in table
    assert "| consistent_hash | 3 |" in table


def test_live_timing_advances_the_clock_when_workers_cost_nothing() -> None:
    # A live request waits before the decision and after the worker; the worker holds its
    # blocks only while it runs it: two 2-block prompts share a 2-block cache at once.
    reqs = trace([1, 2], [3, 4], [1, 2], [3, 4], [1, 2], [3, 4])
    timed = simulate(reqs, config(1, 2, "round_robin", concurrency=2, route_delay_s=0.1,
                                  relay_delay_s=0.3))
    assert timed.sim_seconds == pytest.approx(3 * 0.4)  # three waves of two
    assert timed.ttft_s == pytest.approx((0.1,) * 6)  # nobody waited for blocks
    untimed = simulate(reqs, config(1, 2, "round_robin", concurrency=2))
    assert untimed.sim_seconds == 0.0
    # Each request's own (wait, hold), cycled, replace both delays: the third request is
    # decided 0.3 s after its send and settles 0.9 s after that. The worker frees each one
    # when it has computed it (at once, free costs), not when the gateway settles it:
    # request 1 finds request 0's blocks free although request 0 is still in flight.
    slow = simulate(reqs[:3], config(1, 2, "round_robin", concurrency=2, route_delay_s=5.0,
                                     relay_delay_s=5.0,
                                     request_delays=((0.1, 0.3), (0.1, 0.3), (0.3, 0.9))))
    assert slow.sim_seconds == pytest.approx(0.4 + 1.2)
    assert slow.ttft_s == pytest.approx((0.1, 0.1, 0.3))
    assert slow.reused == (0, 0, 0)  # [1, 2], [3, 4], [1, 2] on a 2-block cache


def test_the_gateway_decides_in_the_order_requests_reach_it() -> None:
    # Request 1 waits less than request 0, but one event loop decides them in order: with
    # both on prompt [1, 2], request 0 is the cold placement and request 1 finds it.
    reqs = trace([1, 2], [1, 2])
    result = simulate(reqs, config(2, 4, "cache_aware", concurrency=2,
                                   request_delays=((0.3, 0.1), (0.1, 0.1))))
    assert result.assignments[0] == result.assignments[1]
    assert result.reasons == {"cold": 1, "prefix_hit": 1}
    assert result.ttft_s == pytest.approx((0.3, 0.3))


def test_decisions_are_at_least_the_gateway_gap_apart() -> None:
    # Three requests sent at once: decided 0.01 s apart, in order, when the gap is set.
    reqs = trace([1], [2], [3])
    spaced = simulate(reqs, config(3, 4, "round_robin", concurrency=3, decision_gap_s=0.01,
                                   request_delays=((0.0, 0.5),)))
    assert spaced.ttft_s == pytest.approx((0.0, 0.01, 0.02))
    bunched = simulate(reqs, config(3, 4, "round_robin", concurrency=3,
                                    request_delays=((0.0, 0.5),)))
    assert bunched.ttft_s == pytest.approx((0.0, 0.0, 0.0))


def test_a_request_holds_its_worker_for_its_live_hold_or_its_simulated_time() -> None:
    # The hold counts from the decision and includes the worker's own time: a worker that
    # takes 0.2 s settles a request held 0.5 s at 0.1 + 0.5, one held 0.05 s when it is done.
    reqs = trace([1], output=2)  # one decode step after the first token: 0.2 s
    costs = SimCosts(prefill_us_per_token=0.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=200.0)
    long_hold = simulate(reqs[:1], config(1, 4, "round_robin", concurrency=1, costs=costs,
                                          request_delays=((0.1, 0.5),)))
    assert long_hold.sim_seconds == pytest.approx(0.6)
    short_hold = simulate(reqs[:1], config(1, 4, "round_robin", concurrency=1, costs=costs,
                                           request_delays=((0.1, 0.05),)))
    assert short_hold.sim_seconds == pytest.approx(0.3)


class _Watched(ClusterSim):
    """The simulator, noting the requests in flight per worker that each decision saw."""

    seen: list[dict[str, int]]

    def _dispatch(self, req: TraceRequest, now: float, *args: Any) -> None:
        views = self.pool.snapshot(now).workers
        self.seen.append({w.id: w.inflight_requests for w in views})
        super()._dispatch(req, now, *args)


def _in_flight_at_second_decision(mode: str, hold_s: float) -> int:
    """Requests in flight the second request's decision saw (0.1 s after the first's), on
    the first's worker: the first held ``hold_s`` by the live gateway, its engine busy 0.2 s."""
    costs = SimCosts(prefill_us_per_token=0.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=200.0)
    reqs = trace([1], [2], output=2, gap_s=0.1)  # one decode step: the engine takes 0.2 s
    sim = _Watched(config(2, 4, "least_load", mode=mode, concurrency=2, costs=costs,
                          request_delays=((0.0, hold_s), (0.0, hold_s))))
    sim.seen = []
    result = sim.run(reqs)
    first = result.assignments[0]
    return sim.seen[1][first]


def test_at_the_live_decision_instants_the_gateway_settles_at_its_live_hold() -> None:
    # At the gateway's own decision instants (mode "replay"), a request counts in flight for
    # its live hold, even where the simulated engine runs longer: the live gateway had the
    # reply then. From the client's timing (mode "sequential") the engine's end stays in the
    # loop: an answer cannot come before the engine is done.
    assert _in_flight_at_second_decision("replay", 0.05) == 0
    assert _in_flight_at_second_decision("replay", 0.5) == 1  # a hold past the decision
    assert _in_flight_at_second_decision("sequential", 0.05) == 1


def test_rebalancer_shrinks_an_unknown_cache_that_mispredicts() -> None:
    # Two workers of 4 blocks, six 2-block prompts in turn: each worker is sent three prompts
    # (6 blocks), so the index, which does not know the size, predicts hits the worker
    # evicted; the rebalancer's rounds (every 3 simulated seconds) shrink its model.
    # The session's own capacity learning is off here (it corrects such a model by itself,
    # below), so the mispredictions reach the rebalancer.
    reqs = trace(*([[10 * p, 10 * p + 1] for p in range(6)] * 40))
    base = config(2, 4, "cache_aware", relay_delay_s=0.05, index_knows_capacity=False)

    def unlearned(cfg: SimConfig) -> SimResult:
        sim = ClusterSim(cfg)
        sim.session.learn_capacity = False
        return sim.run(reqs)

    on = unlearned(dataclasses.replace(base, rebalance_interval_s=3.0))
    off = unlearned(dataclasses.replace(base, rebalance_interval_s=0.0))
    assert on.rebalance.get("shrink_capacity", 0) > 0
    assert off.rebalance == {}


def test_the_session_learns_an_unknown_cache_size_without_the_rebalancer() -> None:
    reqs = trace(*([[10 * p, 10 * p + 1] for p in range(6)] * 40))
    sim = ClusterSim(config(2, 4, "cache_aware", index_knows_capacity=False,
                            rebalance_interval_s=0.0))
    result = sim.run(reqs)
    assert result.rebalance == {}
    # Each worker is sent three 2-block prompts for a 4-block cache: the model shrinks from
    # the index's default to about what the worker holds, and stops predicting evicted hits.
    assert all(sim.index.capacity(wid) <= 6 for wid in ("w0", "w1"))
    assert result.reasons.get("prefix_hit", 0) <= 2


@pytest.mark.parametrize(("blocks", "per_block"), [(3, 1), (10, 1), (200, 1), (100, 2)])
def test_gateway_key_has_the_fingerprints_checkpoints(blocks: int, per_block: int) -> None:
    key = gateway_key(prefix_key(range(blocks), 512 * blocks), per_block)
    text = "x" * (64 * blocks * per_block)
    fp = fingerprint(text, Namespace())
    assert key.depths == fp.depths
    assert key.blocks.index(key.anchor) == fp.blocks.index(fp.anchor)
    # A shared prefix of trace blocks shares exactly the checkpoints inside it.
    other = gateway_key(prefix_key([*range(blocks - 1), 10**6], 512 * blocks), per_block)
    shared = [a == b for a, b in zip(key.blocks, other.blocks, strict=True)]
    inside = [d <= (blocks - 1) * per_block for d in key.depths]
    assert shared == inside


def _first_tokens(streaming: bool) -> tuple[list[int], int]:
    """(queued prefill of the worker at each first token the session saw, left at the end)."""
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=10.0)
    sim = ClusterSim(config(1, 8, "cache_aware", costs=costs, streaming=streaming))
    seen: list[int] = []
    first_token = sim.session.first_token

    def spy(attempt: Attempt) -> None:
        seen.append(sim.pool.get(attempt.worker_id).inflight_prefill)
        first_token(attempt)

    sim.session.first_token = spy  # type: ignore[method-assign]
    sim.run(trace([1, 2], [3, 4], tokens=1000, output=5))
    return seen, sim.pool.states()[0].inflight_prefill


def test_streamed_replies_release_the_queued_prefill_at_the_first_token() -> None:
    assert _first_tokens(streaming=False) == ([], 0)
    seen, left = _first_tokens(streaming=True)
    # Counted as queued until the first token (each request, one at a time), none at the end.
    assert len(seen) == 2
    assert all(q > 0 for q in seen)
    assert left == 0


def test_private_blocks_are_held_while_running_and_never_cached() -> None:
    # An engine's partial last block: one more block per running request, freed at the end.
    reqs = trace(*LRU_SEQUENCE)
    roomy = ClusterSim(config(1, 100, "round_robin", private_blocks=1))
    roomy.run(reqs)
    (cache,) = [w.cache for w in roomy.workers.values()]
    assert cache.cached_blocks == 7  # blocks 1..7: no private block stays cached
    assert cache.free_blocks == 100 - 7
    # In 4 blocks, the running request's own block evicts what the next one would reuse.
    tight = simulate(reqs, config(1, 4, "round_robin", private_blocks=1))
    assert tight.matched_blocks < simulate(reqs, config(1, 4, "round_robin")).matched_blocks
    # A prompt as large as the cache never fits beside its own block.
    assert simulate(trace([1, 2, 3, 4]), config(1, 4, "round_robin",
                                                private_blocks=1)).rejected == 1


def test_a_live_rebalance_action_is_applied_at_its_instant() -> None:
    # One worker of 8 blocks, the same 2-block prompt at 0 s and 1 s: the index predicts the
    # second finds both blocks. A live shed of every prefix the worker held, logged at 0.5 s,
    # leaves the index nothing to predict (the worker itself still holds them), and the
    # simulator's own rebalancer rounds do not run beside the log.
    reqs = [dataclasses.replace(r, arrival_s=float(i)) for i, r in enumerate(trace([1, 2], [1, 2]))]
    base = config(1, 8, "cache_aware", mode="replay", concurrency=None)
    plain = simulate(reqs, base)
    assert plain.predicted_blocks == 2
    assert plain.matched_blocks == 2
    shed = Shed("live:1:shed", 0.0, "w0", 1.0, "thrashing")
    logged = simulate(reqs, dataclasses.replace(base, worker_names=("w0",),
                                                rebalance_log=((0.5, shed),)))
    assert logged.predicted_blocks == 0
    assert logged.matched_blocks == 2
    assert logged.rebalance == {"shed": 1}
    late = simulate(reqs, dataclasses.replace(base, worker_names=("w0",),
                                              rebalance_log=((1.5, shed),)))
    assert late.predicted_blocks == 2  # after the last request: changes nothing it routed


def test_an_engine_scrape_counts_in_the_worker_view_from_its_instant() -> None:
    # A scrape logged at 0.5 s in which worker a's engine runs three requests and queues one:
    # from then on the pool's view of a counts four requests, as the live gateway's does (its
    # view takes the engine's running and waiting requests at the last scrape when that is
    # more than its own count). Without the log, the view is the gateway's own count.
    reqs = [dataclasses.replace(r, arrival_s=1.0) for r in trace([1, 2])]
    base = config(2, 8, "least_load", mode="replay", concurrency=None, worker_names=("a", "b"))
    busy = {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 1.0}
    sim = ClusterSim(dataclasses.replace(base, scrape_log=((0.5, "a", busy, None),)))
    sim.run(reqs)
    assert sim.pool.get("a").view().inflight_requests == 4
    assert sim.pool.get("b").view().inflight_requests == 0
    plain = ClusterSim(base)
    plain.run(reqs)
    assert plain.pool.get("a").view().inflight_requests == 0


def test_a_logged_scrape_counts_only_the_engines_load_beyond_the_live_gateways_own() -> None:
    # The same scrape of worker a (three running, one waiting), logged with the two requests
    # the live gateway had in flight there then: the view counts the other two as load from
    # elsewhere, not the four the simulated gateway's own count (none in flight at 0.5 s)
    # would leave.
    reqs = [dataclasses.replace(r, arrival_s=1.0) for r in trace([1, 2])]
    base = config(2, 8, "least_load", mode="replay", concurrency=None, worker_names=("a", "b"))
    busy = {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 1.0}
    logged = ClusterSim(dataclasses.replace(base, scrape_log=((0.5, "a", busy, 2),)))
    logged.run(reqs)
    assert logged.pool.get("a").view().inflight_requests == 2


# Engine histograms as a live gateway's start-up probe round reads them after the replay
# harness warmed each worker with 8 requests: first tokens within 0.5 ms on average, or 0.5 s.
_QUICK = {FIRST_TOKEN_TIME_SUM: 0.004, FIRST_TOKEN_TIME_COUNT: 8.0}
_SLOW = {FIRST_TOKEN_TIME_SUM: 4.0, FIRST_TOKEN_TIME_COUNT: 8.0}


def test_the_fleet_begins_as_the_live_gateways_start_up_probes_found_it() -> None:
    # 24 requests on one 8-block trunk, 12 at a time, held 1 s each, under a tight load bound
    # (factor 1): the trunk's holder piles up requests in flight and the bound diverts two,
    # as the gateway does for engines it knows nothing about yet. Engines whose start-up
    # scrape showed quick first tokens are exempt from the bound (quick_first_token_s), as
    # the live gateway's are from its first decision on; slow ones are not.
    shared = list(range(1, 9))
    reqs = trace(*[[*shared, 100 + 2 * i, 101 + 2 * i] for i in range(24)])
    names = ("a", "b", "c", "d")
    base = config(4, 1000, "cache_aware", concurrency=12, relay_delay_s=1.0,
                  probe_interval_s=0.0, worker_names=names,
                  policy_options=PolicyOptions(cache_aware_load_factor=1.0))
    unknown = simulate(reqs, base)
    quick = simulate(reqs, dataclasses.replace(
        base, start_scrapes=tuple((w, _QUICK) for w in names)))
    slow = simulate(reqs, dataclasses.replace(
        base, start_scrapes=tuple((w, _SLOW) for w in names)))
    assert unknown.reasons.get("diverted:bounded_load", 0) > 0
    assert slow.reasons == unknown.reasons
    assert "diverted:bounded_load" not in quick.reasons
    assert quick.reasons.get("prefix_hit", 0) > unknown.reasons.get("prefix_hit", 0)


def test_an_engine_started_from_a_scrape_counts_on_from_its_histograms() -> None:
    # The pool reads the start-up scrape as the gateway does (8 first tokens, 4 ms: 0.5 ms
    # each); the simulated engine's own histograms go on from the scrape's counters, so the
    # next probe's mean is of the requests it took since, not a counter gone back (which
    # the gateway reads as a restart).
    names = ("a", "b")
    sim = ClusterSim(config(2, 8, "round_robin", worker_names=names, probe_interval_s=0.0,
                            start_scrapes=(("a", _QUICK),)))
    assert sim.pool.get("a").first_token_s == pytest.approx(0.0005)
    assert sim.pool.get("b").first_token_s is None
    sim.run(trace([1, 2], [3, 4], [5, 6], [7, 8]))
    served = sim.workers["a"].routed
    assert served == 2
    assert sim.workers["a"].metrics()[FIRST_TOKEN_TIME_COUNT] == 8 + served
    assert sim.workers["b"].metrics()[FIRST_TOKEN_TIME_COUNT] == 2
    assert sim.workers["a"].metrics()[FIRST_TOKEN_TIME_SUM] >= 0.004


class _ProbeTimes(ClusterSim):
    """The simulator, noting which worker each of its health probes read, and when (the
    instant the event loop reached it: the probe's due time)."""

    probed: list[tuple[float, str]]

    def _probe(self) -> None:
        self.probed = getattr(self, "probed", [])
        before = {s.worker.id: s.engine_metrics for s in self.pool.states()}
        super()._probe()
        changed = sorted(s.worker.id for s in self.pool.states()
                         if s.engine_metrics is not before[s.worker.id])
        self.probed.append((self._next_probe, ", ".join(changed)))


def test_the_simulated_gateway_probes_its_workers_in_turn_evenly_apart() -> None:
    # Four workers probed every 2 s, as the live gateway spreads a round: one every 0.5 s, in
    # the order of their names, each once per round, the first round from 2 s on (the
    # gateway's start-up round probed them all at 0).
    reqs = [dataclasses.replace(r, arrival_s=6.2) for r in trace([1, 2])]
    base = config(4, 8, "least_load", mode="replay", concurrency=None,
                  worker_names=("d", "b", "a", "c"), probe_interval_s=2.0)
    sim = _ProbeTimes(base)
    sim.run(reqs)
    assert sim.probed == [(2.5, "a"), (3.0, "b"), (3.5, "c"), (4.0, "d"),
                          (4.5, "a"), (5.0, "b"), (5.5, "c"), (6.0, "d")]


def test_the_gateway_probes_the_simulated_engines_for_their_times_to_first_token() -> None:
    # One worker, 100 us per uncached token: two 1,024-token prompts sent at 0 s prefill one
    # after the other (first tokens at 0.1024 and 0.2048 s, both admitted at once); a third
    # comes at 2 s. The probe at 1 s reads the engine's histograms, as the gateway's health
    # probe reads vLLM's: a mean time to first token of 0.1536 s and no admission wait.
    costs = SimCosts(prefill_us_per_token=100.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    reqs = trace([1, 2], [3, 4], [5, 6])
    reqs[2] = dataclasses.replace(reqs[2], arrival_s=2.0)
    reqs[1] = dataclasses.replace(reqs[1], arrival_s=0.0)
    base = config(1, 16, "least_load", mode="replay", concurrency=None, costs=costs,
                  probe_interval_s=1.0, prewarm=False)
    sim = ClusterSim(base)
    sim.run(reqs)
    state = sim.pool.get(sim.pool.states()[0].worker.id)
    assert state.first_token_s == pytest.approx(0.1536)
    assert state.queue_s == 0.0
    assert state.view().first_token_s == state.first_token_s
    unprobed = ClusterSim(dataclasses.replace(base, probe_interval_s=0.0))
    unprobed.run(reqs)
    assert unprobed.pool.states()[0].first_token_s is None
