"""How the live replay turns a run's measurements into the simulator's timing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.fingerprint import PrefixKey
from gateway.routing.policies import PolicyOptions
from loadtest.harness import Reply, server_timing
from loadtest.replay import (
    DryRunPair,
    ReplayConfig,
    RunResult,
    Scrape,
    agreement,
    markdown,
    medians,
    summarize,
    time_actions,
    timed_scrapes,
)
from loadtest.replay_sim import (
    SIM_KEYS,
    decision_gap,
    delay_factors,
    gateway_keys,
    live_timing,
    request_delays,
    session_waits,
    sim_overrides,
    simulated,
    start_scrapes,
    with_overrides,
)
from loadtest.sim import ClusterSim, SimConfig
from loadtest.sim.cluster import gateway_key
from loadtest.sim.report import percentile
from loadtest.traces import TraceRequest, prefix_key


def run(requests: int, seconds: float, latency_ms: float, inflight: float | None) -> RunResult:
    return RunResult(
        router="ours:cache_aware", repeat=0, requests=requests, errors=0, block_hit_rate=0.5,
        pooled_bound=0.6, hit_over_bound=0.8, routed_max_over_mean=1.0,
        requests_max_over_mean=1.0, prefill_max_over_mean=1.0, p50_ms=latency_ms,
        p99_ms=latency_ms, cpu_s_per_1k=None, seconds=seconds, mean_latency_ms=latency_ms,
        gateway_inflight=inflight,
    )


def flat(pairs: tuple[tuple[float, float], ...]) -> tuple[float, ...]:
    return tuple(x for pair in pairs for x in pair)


def test_the_gateway_holds_its_share_of_the_latency() -> None:
    config = ReplayConfig(workers=4, cache_blocks=100, concurrency=32)
    # 100 requests/s at 320 ms: 32 in flight at the client, 24 of them decided by the gateway.
    route, relay = live_timing(run(1000, 10.0, 320.0, 24.0), config)
    assert (route, relay) == pytest.approx((0.08, 0.24))
    # No sample: the gateway holds the whole latency.
    assert live_timing(run(1000, 10.0, 320.0, None), config) == pytest.approx((0.0, 0.32))
    assert live_timing(run(0, 0.0, 0.0, None), config) == (0.0, 0.0)


def test_each_request_keeps_its_live_latency() -> None:
    config = ReplayConfig(workers=4, cache_blocks=100, concurrency=32)
    measured = run(3, 1.0, 200.0, None)
    measured.latencies_ms = [100.0, 200.0, 300.0]
    assert delay_factors(measured) == pytest.approx((0.5, 1.0, 1.5))
    assert delay_factors(run(3, 1.0, 200.0, None)) == ()
    # Without the gateway's timing: the run's mean split, scaled per request (no sample: the
    # gateway held it all).
    assert flat(request_delays(measured, config)) == pytest.approx((0.0, 0.1, 0.0, 0.2, 0.0, 0.3))
    # With it: each request's own hold, and the rest of its latency before the decision.
    measured.upstream_ms = [40.0, 150.0, 300.0]
    assert flat(request_delays(measured, config)) == pytest.approx(
        (0.06, 0.04, 0.05, 0.15, 0.0, 0.3))


def test_server_timing_reads_the_durations_it_understands() -> None:
    assert server_timing("wait;dur=0.41, upstream;dur=7.25") == {"wait": 0.41, "upstream": 7.25}
    assert server_timing('db;desc="x";dur="3", cache;desc=hit') == {"db": 3.0}
    assert server_timing("") == {}
    assert server_timing("a;dur=nan, b;dur=-1, c;dur=x, ;dur=2") == {}


def test_simulated_engines_prefill_what_the_live_workers_would_and_the_table_shows_it() -> None:
    """The live replay's blocks are its workers' blocks (16 tokens here): the second prompt
    shares one of its four blocks with the first and prefills the other 48 tokens (4.8 ms at
    100 us a token), as the reference worker would; the simulated rows show the engines' time
    to first token where the live rows show their latency."""
    reqs = [TraceRequest(0, 0.0, 2048, 1, prefix_key([1, 2, 3, 4], 2048)),
            TraceRequest(1, 0.0, 2048, 1, prefix_key([1, 5, 6, 7], 2048))]
    config = ReplayConfig(workers=1, cache_blocks=50, concurrency=1, prefill_us_per_token=100.0)
    assert config.block_tokens == 16
    sim = simulated(reqs, config, "round_robin", pooled=1.0)
    hand = (64 * 0.1, 48 * 0.1)  # ms: 64 and 48 uncached tokens
    assert sim["ttft_p50_ms"] == pytest.approx(percentile(hand, 50))
    assert sim["ttft_p99_ms"] == pytest.approx(percentile(hand, 99))
    row = {"router": "ours:round_robin", "repeats": 1, **{k: sim[k] for k in SIM_KEYS}}
    text = markdown([], [row])
    assert f"| {sim['ttft_p50_ms']:.1f} | {sim['ttft_p99_ms']:.1f} | - | 0 |" in text
    assert "p50 and p99 are the simulated engines' time to first token" in text


def test_simulated_balance_counts_blocks_as_the_live_run_does() -> None:
    # Round-robin over two workers: 10-block prompts all on one, 1-block ones on the other.
    reqs = [TraceRequest(i, 0.0, 512 * n, 1, prefix_key(range(100 * i, 100 * i + n), 512 * n))
            for i, n in enumerate([10, 1, 10, 1])]
    sim = simulated(reqs, ReplayConfig(workers=2, cache_blocks=50, concurrency=1),
                    "round_robin", pooled=1.0)
    assert sim["routed_max_over_mean"] == pytest.approx(20 / 11)
    assert sim["requests_max_over_mean"] == 1.0
    assert sim["same_worker"] is None  # no live assignments to compare with
    # Round-robin goes a, b, a, b: three of the four live choices below agree.
    compared = simulated(reqs, ReplayConfig(workers=2, cache_blocks=50, concurrency=1),
                         "round_robin", pooled=1.0, worker_ids=("a", "b"),
                         routed_to=("a", "b", "b", "b"))
    assert compared["same_worker"] == pytest.approx(0.75)


def test_at_the_gateways_decision_instants_requests_are_decided_in_that_order() -> None:
    """Live, request 1 was decided before request 0 (its connection was ready first): at the
    decision instants the simulator decides them in that order, and reports each where it
    went in trace order; without them it decides in send order."""
    reqs = [TraceRequest(i, 0.0, 512, 1, prefix_key([10 * i], 512)) for i in range(4)]
    config = ReplayConfig(workers=2, cache_blocks=50, concurrency=1)
    live = ("b", "a", "a", "b")  # round-robin a, b, a, b in the order 1, 0, 2, 3
    holds = [(0.0, 0.001)] * 4
    timed = simulated(reqs, config, "round_robin", pooled=1.0, worker_ids=("a", "b"),
                      delays=holds, routed_to=live, decided_s=(0.002, 0.001, 0.003, 0.004))
    assert timed["timing"] == "decisions"
    assert timed["same_worker"] == 1.0
    untimed = simulated(reqs, config, "round_robin", pooled=1.0, worker_ids=("a", "b"),
                        delays=holds, routed_to=live)
    assert untimed["timing"] == "client"
    assert untimed["same_worker"] == 0.5


def a_b_c_then_a() -> tuple[list[TraceRequest], ReplayConfig]:
    """Prompts A, B and C of 8 blocks each, then A again, for one worker of 20 blocks."""
    a = prefix_key(range(8), 512 * 8)
    reqs = [TraceRequest(0, 0.0, 512 * 8, 1, a),
            TraceRequest(1, 0.0, 512 * 8, 1, prefix_key(range(100, 108), 512 * 8)),
            TraceRequest(2, 0.0, 512 * 8, 1, prefix_key(range(200, 208), 512 * 8)),
            TraceRequest(3, 0.0, 512 * 8, 1, a)]
    return reqs, ReplayConfig(workers=1, cache_blocks=20, concurrency=4)


def test_a_worker_frees_a_request_when_done_whatever_the_gateways_hold() -> None:
    """Two prompts of 8 blocks on one worker of 20 (free costs), A held longer than B live
    and no engine saying when it freed them:
    the engine frees each one when it has computed it, in the order they reached it (A, then
    B), not when the gateway read the reply. So the 8 blocks of C evict A's deepest 4, and A's
    prompt again (D) finds 4 of its 8 blocks, with the live holds as with equal ones (were A's
    blocks kept until its reply came back, C would evict B's and D would find all 8)."""
    reqs, config = a_b_c_then_a()
    decided = (0.0, 0.0001, 0.5, 0.6)
    for holds in ([(0.0, 0.3), (0.0, 0.1), (0.0, 0.01), (0.0, 0.01)], [(0.0, 0.01)] * 4):
        sim = simulated(reqs, config, "round_robin", pooled=1.0, delays=holds,
                        decided_s=decided, cached=(0, 0, 0, 4))
        assert sim["block_hit_rate"] == pytest.approx(4 / 32)
        assert sim["same_cached"] == 1.0  # each request reused what the live one reported


def test_same_cached_is_the_share_of_requests_reusing_what_they_did_live() -> None:
    """The same prompt twice on one worker: the second reuses its 8 blocks. A live run that
    reported 8 for it agrees on both requests; one that reported 5 on one of two."""
    a = prefix_key(range(8), 512 * 8)
    reqs = [TraceRequest(0, 0.0, 512 * 8, 1, a), TraceRequest(1, 0.0, 512 * 8, 1, a)]
    config = ReplayConfig(workers=1, cache_blocks=20, concurrency=1)
    holds = [(0.0, 0.01)] * 2
    agree = simulated(reqs, config, "round_robin", pooled=1.0, delays=holds,
                      decided_s=(0.0, 0.1), cached=(0, 8))
    assert agree["same_cached"] == 1.0
    differ = simulated(reqs, config, "round_robin", pooled=1.0, delays=holds,
                       decided_s=(0.0, 0.1), cached=(0, 5))
    assert differ["same_cached"] == 0.5
    unknown = simulated(reqs, config, "round_robin", pooled=1.0, delays=holds,
                        decided_s=(0.0, 0.1))
    assert unknown["same_cached"] is None


def test_agreement_is_the_largest_difference_run_by_run() -> None:
    from loadtest.replay_sim import agreement

    def run(live: tuple[float, float], client: tuple[float, float],
            decisions: tuple[float, float]) -> dict[str, Any]:
        def figures(pair: tuple[float, float]) -> dict[str, float]:
            return {"hit_over_bound": pair[0], "routed_max_over_mean": pair[1]}

        return {**figures(client), "live": figures(live), "decisions": figures(decisions)}

    runs = [run((0.98, 1.10), (0.99, 1.00), (0.98, 1.10)),
            run((0.97, 1.20), (0.95, 1.25), (0.975, 1.20))]
    found = agreement(runs)
    assert found["client"] == pytest.approx({"hit": -0.02, "balance": -0.10})
    assert found["decisions"] == pytest.approx({"hit": 0.005, "balance": 0.0})
    del runs[0]["decisions"]  # a run that did not say when it decided: the client model only
    assert set(agreement(runs)) == {"client"}


def test_sim_set_reads_each_change_as_its_fields_type() -> None:
    from loadtest.sim.cluster import SimConfig

    changes = sim_overrides(["prewarm=false", "policy.volume_guard=1.1",
                             "policy.ring_choices=2", "rebalance_interval_s=0",
                             "reuse=computed"])
    assert changes == {"prewarm": False, "rebalance_interval_s": 0.0, "reuse": "computed",
                       "policy_options": {"volume_guard": 1.1, "ring_choices": 2}}
    sim = with_overrides(SimConfig(workers=2, cache_blocks=10, policy="cache_aware"), changes)
    assert (sim.prewarm, sim.rebalance_interval_s) == (False, 0.0)
    assert (sim.policy_options.volume_guard, sim.policy_options.ring_choices) == (1.1, 2)
    assert sim.policy_options.load_factor == SimConfig(2, 10, "x").policy_options.load_factor
    for bad in ("prewarm", "prewarm=maybe", "workers=3", "policy.nope=1",
                "policy.ring_choices=two", "reuse=never", "mode=sequential"):
        with pytest.raises(ValueError, match="--sim-set"):
            sim_overrides([bad])


def test_the_gap_between_decisions_is_the_gateways_cpu_per_request() -> None:
    measured = run(1000, 1.0, 20.0, None)
    assert decision_gap(measured) == 0.0  # not measured
    measured.cpu_s_per_1k = 1.5
    assert decision_gap(measured) == pytest.approx(0.0015)


def test_the_simulator_routes_on_the_keys_the_gateway_computes() -> None:
    from gateway.fingerprint import Namespace, fingerprint
    from gateway.openai_schema import parse_completion
    from gateway.settings import GatewaySettings
    from loadtest.replay import request_bodies

    config = ReplayConfig(workers=2, cache_blocks=100)
    requests = [TraceRequest(i, 0.0, 64, 1, prefix_key(blocks, 64))
                for i, blocks in enumerate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8]])]
    keys = gateway_keys(requests, config, "m@v1")
    settings = GatewaySettings()
    body = request_bodies(requests, config.block_chars, config.max_tokens)[1]
    text = parse_completion(body, settings.normalize_options()).fingerprint_text
    assert keys[1] == fingerprint(text, Namespace(model="m@v1"), settings.fingerprint_options())
    assert keys[0].blocks[:4] == keys[1].blocks[:4] != keys[2].blocks[:4]
    assert keys[0].anchor == keys[1].anchor
    # Another model version is another namespace: no prefix in common.
    assert not set(gateway_keys(requests, config, "m@v2")[0].blocks) & set(keys[0].blocks)


def rag_under_load() -> tuple[list[TraceRequest], SimConfig]:
    """RAG documents under load, where the pre-warmer's rule fires: the requests, and the
    simulator's configuration for them."""
    from loadtest.replay_sim import live_units
    from loadtest.trace_workloads import workload_trace

    config = ReplayConfig(workers=8, cache_blocks=150, concurrency=32)
    requests = live_units(workload_trace("rag", 200, 0), config)
    return requests, SimConfig(
        workers=8, cache_blocks=150, policy="cache_aware", concurrency=32,
        costs=config.sim_costs(), key_blocks_per_block=1, request_delays=((0.01, 0.007),),
        decision_gap_s=0.0003)


def test_the_simulator_pre_warms_as_the_gateway_does() -> None:
    # RAG documents under load: the gateway's pre-warmer copies hot documents to their next
    # holder (recorded as sent), and the simulator runs that very pre-warmer; switched off,
    # none are sent and the hot documents keep fewer holders.
    requests, base = rag_under_load()
    holders = {}
    for prewarm in (True, False):
        sim = ClusterSim(dataclasses.replace(base, prewarm=prewarm))
        result = sim.run(requests)
        assert (result.prewarms > 0) is prewarm
        assert sim.prewarmer.sent == result.prewarms
        served: dict[int, set[str]] = {}
        for request, worker in zip(requests, result.assignments, strict=True):
            served.setdefault(request.key.blocks[3], set()).add(worker)
        holders[prewarm] = sum(len(workers) for workers in served.values())
    assert holders[True] > holders[False]


def test_the_simulator_copies_the_held_prefix_as_the_gateway_does() -> None:
    # A pre-warm copies the prefix its holder had (gateway.prewarm.held_prefix): on RAG some
    # copies stop where the document's question begins; copying whole requests, none do.
    requests, base = rag_under_load()
    for cut in (True, False):
        sim = ClusterSim(dataclasses.replace(base, prewarm_cut=cut))
        copies: list[tuple[TraceRequest, PrefixKey]] = []
        original = sim._prewarm

        def spy(wid: str, req: TraceRequest, key: PrefixKey, *args: Any,
                copies: list[tuple[TraceRequest, PrefixKey]] = copies,
                original: Any = original, **kwargs: Any) -> None:
            copies.append((req, key))
            original(wid, req, key, *args, **kwargs)

        sim._prewarm = spy  # type: ignore[method-assign]
        sim.run(requests)
        assert copies
        whole = gateway_key(requests[0].key, 1)  # the key blocks of one trace block
        assert len(whole.blocks) == len(requests[0].blocks)
        short = [key for req, key in copies if key.total_blocks < len(req.blocks)]
        assert bool(short) is cut
        for req, key in copies:  # a prefix of the request's own key
            assert key.blocks == gateway_key(req.key, 1).blocks[:len(key.blocks)]


def test_the_simulator_moves_sessions_by_copies_as_the_gateway_does() -> None:
    # Long agent sessions with the volume guard on: the simulated gateway copies sessions
    # whole (the request's own key, every block) to where they move, never two at once to one
    # worker, and then routes their next turns there; the guard evens the routed volume out
    # with fewer misses than cold moves (the same guard moving sessions at once), and fewer
    # again where a copy that lacks turns is brought up to date before the session moves
    # (volume_refresh). Four sessions at a time on sixteen workers: the pool has the
    # capacity copies are made with.
    from loadtest.replay_sim import live_units
    from loadtest.trace_workloads import workload_trace

    config = ReplayConfig(workers=16, cache_blocks=2000, concurrency=4)
    requests = live_units(workload_trace("agent-sessions", 2400, 0)[2000:], config)
    base = SimConfig(workers=16, cache_blocks=2000, policy="cache_aware", concurrency=4,
                     costs=config.sim_costs(), key_blocks_per_block=1,
                     request_delays=((0.01, 0.007),), decision_gap_s=0.0003)
    results = {}
    for copy, refresh in ((True, True), (True, False), (False, False)):
        options = PolicyOptions(volume_guard=1.2, volume_copy=copy, volume_refresh=refresh)
        sim = ClusterSim(dataclasses.replace(base, policy_options=options))
        copies: list[tuple[str, TraceRequest, PrefixKey]] = []
        busy: dict[str, int] = {}
        original, done = sim._prewarm, sim._prewarmed

        def spy(wid: str, req: TraceRequest, key: PrefixKey, *args: Any,
                copies: list[tuple[str, TraceRequest, PrefixKey]] = copies,
                original: Any = original, busy: dict[str, int] = busy,
                **kwargs: Any) -> None:
            copies.append((wid, req, key))
            busy[wid] = busy.get(wid, 0) + 1
            assert busy[wid] == 1  # one copy at a time per worker
            original(wid, req, key, *args, **kwargs)

        def finished(job: Any, now: float, done: Any = done,
                     busy: dict[str, int] = busy) -> None:
            busy[job.copy_of] -= 1
            done(job, now)

        sim._prewarm = spy  # type: ignore[method-assign]
        sim._prewarmed = finished  # type: ignore[method-assign]
        result = sim.run(requests)
        results[copy, refresh] = result
        assert bool(copies) is copy
        for _, req, key in copies:
            assert key.blocks == gateway_key(req.key, 1).blocks  # whole
        if copy:
            assert sum(w == dest for dest, *_ in copies for w in result.assignments) > 0
    refreshed, moved, cold = results[True, True], results[True, False], results[False, False]
    # Moved to a copy made some turns before, a session redoes those turns (diverted), where
    # a cold move redoes the whole history; brought up to date first, it redoes none of
    # them (its copy holds all its holder's index knows of).
    diverted = [r.reasons.get("diverted:volume_guard", 0) for r in (refreshed, moved, cold)]
    assert diverted[0] < diverted[1] < diverted[2]
    assert refreshed.matched_blocks > moved.matched_blocks > cold.matched_blocks


def test_a_copy_keeps_its_worker_from_another_for_the_live_copy_time() -> None:
    # A session copy keeps its worker from taking another copy until it ends; with the live
    # run's copy time (SimConfig.copy_hold_s) at least that long from its decision. Over a
    # run shorter than that time, no worker takes two copies; with the simulated copy's own
    # time, some do.
    from loadtest.replay_sim import live_units
    from loadtest.trace_workloads import workload_trace

    config = ReplayConfig(workers=16, cache_blocks=2000, concurrency=32)
    requests = live_units(workload_trace("agent-sessions", 2400, 0)[2000:], config)
    base = SimConfig(workers=16, cache_blocks=2000, policy="cache_aware", concurrency=32,
                     costs=config.sim_costs(), key_blocks_per_block=1,
                     request_delays=((0.01, 0.007),), decision_gap_s=0.0003,
                     policy_options=PolicyOptions(volume_guard=1.2))
    per_worker = {}
    for hold in (0.0, 1000.0):
        sim = ClusterSim(dataclasses.replace(base, copy_hold_s=hold))
        targets: list[str] = []
        original = sim._prewarm

        def spy(wid: str, req: TraceRequest, key: PrefixKey, now: float, hold: float | None,
                session: bool = False, targets: list[str] = targets,
                original: Any = original) -> None:
            if session:
                targets.append(wid)
            original(wid, req, key, now, hold, session)

        sim._prewarm = spy  # type: ignore[method-assign]
        sim.run(requests)  # its requests take seconds: far less than 1,000
        per_worker[hold] = max(targets.count(w) for w in set(targets)) if targets else 0
    assert per_worker[1000.0] == 1
    assert per_worker[0.0] > 1


def test_session_copies_at_a_background_priority_leave_the_prefills_to_the_requests() -> None:
    # Engines whose prefills share compute and that run priority scheduling, the volume guard
    # copying sessions: sent at priority 1 (SimConfig.copy_priority, the gateway's
    # --copy-priority) a copy prefills only while no client request does on its worker, so
    # the copies themselves take longer. Engines on first-come-first-served scheduling
    # refuse it: the copies go as before (four sessions at a time on sixteen workers: the
    # pool has capacity to spare, so the first-come-first-served engines take copies too).
    from loadtest.replay_sim import live_units
    from loadtest.trace_workloads import workload_trace

    config = ReplayConfig(workers=16, cache_blocks=2000, concurrency=4,
                          prefill_us_per_token=50.0)
    requests = live_units(workload_trace("agent-sessions", 2400, 0)[2000:], config)
    base = SimConfig(workers=16, cache_blocks=2000, policy="cache_aware", concurrency=4,
                     costs=dataclasses.replace(config.sim_costs(), prefill_shared=True),
                     block_tokens=config.block_tokens, key_blocks_per_block=1,
                     request_delays=((0.01, 0.007),), decision_gap_s=0.0003,
                     policy_options=PolicyOptions(volume_guard=1.2), priority_engines=True,
                     reuse="scheduled")
    fcfs = [ClusterSim(dataclasses.replace(base, copy_priority=priority,
                                           priority_engines=False)).run(requests).ttft_s
            for priority in (0, 1)]
    assert fcfs[0] == fcfs[1]
    copy_s = {}
    for priority in (0, 1):
        sim = ClusterSim(dataclasses.replace(base, copy_priority=priority))
        took: list[float] = []
        complete = sim._complete

        def spy(w: Any, job: Any, now: float, took: list[float] = took,
                complete: Any = complete) -> None:
            if job.copy_of:  # a session copy's engine work is over
                took.append(now - job.arrived)
            complete(w, job, now)

        sim._complete = spy  # type: ignore[method-assign]
        sim.run(requests)
        assert took  # the guard copied sessions
        copy_s[priority] = sum(took) / len(took)
    assert copy_s[1] > copy_s[0]


def test_a_live_runs_prewarms_are_placed_where_it_placed_them() -> None:
    # Given a live run's pre-warms (SimConfig.prewarm_log, per request), the simulator places
    # exactly those, at those decisions and on those workers, and decides none of its own.
    requests, base = rag_under_load()
    own = ClusterSim(base)
    assert own.run(requests).prewarms > 0  # the rule fires on this trace
    none = ClusterSim(dataclasses.replace(base, prewarm_log=("",) * len(requests)))
    assert none.run(requests).prewarms == 0
    placed: list[tuple[int, str]] = []
    target = sorted(own.workers)[0]
    logged = ClusterSim(dataclasses.replace(
        base, prewarm_log=tuple(target if i in (5, 9) else "" for i in range(len(requests)))))
    original = logged._prewarm

    def spy(wid: str, req: TraceRequest, *args: Any, **kwargs: Any) -> None:
        placed.append((req.index, wid))
        original(wid, req, *args, **kwargs)

    logged._prewarm = spy  # type: ignore[method-assign]
    result = logged.run(requests)
    assert result.prewarms == 2
    assert placed == [(requests[5].index, target), (requests[9].index, target)]


def test_dry_run_agreement_counts_each_side_and_kind_apart() -> None:
    pairs = [
        DryRunPair(across=True, agreed=True, kind="prefix_hit", same_view=True),
        DryRunPair(across=True, agreed=False, kind="cold", same_view=True),
        DryRunPair(across=True, agreed=False, kind="cold", same_view=False),
        DryRunPair(across=False, agreed=True, kind="cold", same_view=True),
    ]
    assert agreement(pairs, across=True) == 1 / 3
    assert agreement(pairs, across=True, kind="cold") == 0.0
    assert agreement(pairs, across=True, kind="prefix_hit") == 1.0
    assert agreement(pairs, across=True, kind="view") == 2 / 3
    assert agreement(pairs, across=False) == 1.0
    assert agreement(pairs, across=False, kind="prefix_hit") is None


def _replies(*decided_at: float) -> list[Reply]:
    return [Reply(status=200, worker="w", input_tokens=16, matched_tokens=0, seconds=0.01,
                  decided_at=at) for at in decided_at]


def test_engine_scrapes_are_timed_on_the_decision_instants() -> None:
    """The gateway's scrapes on its monotonic clock, as the decision instants are: each
    worker's last one before the first decision (at 100.0) and every one after it."""
    scrapes: dict[tuple[str, float], Scrape] = {
        ("a", 90.0): ({"r": 1.0}, 0), ("a", 99.0): ({"r": 2.0}, 1), ("b", 95.0): ({"r": 0.0}, 0),
        ("a", 103.5): ({"r": 3.0}, None)}
    timed = timed_scrapes(scrapes, _replies(100.0, 100.5, 104.0))
    assert [(x["worker"], x["decided_s"], x["metrics"], x["own"]) for x in timed] == [
        ("b", -5.0, {"r": 0.0}, 0), ("a", -1.0, {"r": 2.0}, 1), ("a", 3.5, {"r": 3.0}, None)]
    assert timed_scrapes(scrapes, _replies(100.0, 0.0)) == []  # a reply that did not say


def test_the_fleet_starts_as_the_start_up_scrapes_found_it() -> None:
    """From the client's timing the simulated fleet begins as the live one did: each
    worker's last scrape at or before the first decision (the start-up probe round), none of
    the later ones (the simulator probes its own engines from then on)."""
    scrapes = [
        {"worker": "a", "decided_s": -2.0, "metrics": {"r": 1.0}, "own": 0},
        {"worker": "a", "decided_s": -0.5, "metrics": {"r": 2.0}, "own": 0},
        {"worker": "b", "decided_s": 0.0, "metrics": {"r": 5.0}, "own": None},
        {"worker": "a", "decided_s": 3.5, "metrics": {"r": 3.0}, "own": None},
        {"worker": "c", "decided_s": 4.0, "metrics": {"r": 4.0}, "own": None},
    ]
    assert start_scrapes(scrapes, [0.0, 1.0, 2.0]) == (("a", {"r": 2.0}), ("b", {"r": 5.0}))
    assert start_scrapes(scrapes) == (("a", {"r": 2.0}), ("b", {"r": 5.0}))
    assert start_scrapes(scrapes, [-3.0, 1.0]) == ()
    assert start_scrapes([]) == ()


def test_rebalance_actions_are_timed_on_the_decision_instants() -> None:
    """A wall-clock action at 1,000,010.25 on a machine whose wall clock is 1,000,000 ahead of
    its monotonic one is 10.25 s of monotonic time: 0.25 s after a first decision at 10.0."""
    actions: list[dict[str, Any]] = [{"action": "shed", "at": 1_000_010.25}]
    time_actions(actions, _replies(10.0, 10.2), 1_000_000.0)
    assert actions[0]["decided_s"] == pytest.approx(0.25)


def test_a_run_splits_its_latency_by_the_gateways_server_timing() -> None:
    config = ReplayConfig(workers=2, cache_blocks=100, concurrency=4)

    def reply(seconds: float, gateway_ms: float = 0.0, upstream_ms: float = 0.0) -> Reply:
        return Reply(status=200, worker="w1", input_tokens=64, matched_tokens=0,
                     seconds=seconds, gateway_ms=gateway_ms, upstream_ms=upstream_ms)

    ours = summarize("ours:cache_aware", 0, [reply(0.010, 0.2, 6.0), reply(0.020, 0.4, 15.0),
                                             reply(0.030, 3.0, 20.0)],
                     1.0, 0.5, None, ["w1", "w2"], config)
    assert (ours.gateway_p50_ms, ours.gateway_p99_ms) == (0.4, 3.0)
    assert (ours.upstream_p50_ms, ours.upstream_p99_ms) == (15.0, 20.0)
    # A peer says nothing: no split, in the run or in the medians.
    peer = summarize("sglang-router", 0, [reply(0.010), reply(0.020)], 1.0, 0.5, None,
                     ["w1", "w2"], config)
    assert peer.gateway_p50_ms is None
    assert peer.upstream_p99_ms is None
    rows = medians([ours, peer])
    assert rows[0]["gateway_p99_ms"] == 3.0
    assert rows[1]["gateway_p99_ms"] is None
    text = markdown(rows, [])
    assert "ours:cache_aware, where the latency went by its Server-Timing: the gateway's own " \
           "time p50 0.40 / p99 3.00 ms, the worker's p50 15.0 / p99 20.0 ms" in text
    assert "sglang-router, where" not in text


def test_our_runs_carry_the_gateways_loop_lag_into_the_medians_and_the_table() -> None:
    config = ReplayConfig(workers=2, cache_blocks=100, concurrency=4)
    reply = Reply(status=200, worker="w1", input_tokens=64, matched_tokens=0, seconds=0.01)
    runs = [summarize("ours:cache_aware", i, [reply], 1.0, 0.5, None, ["w1", "w2"], config)
            for i in range(3)]
    for run, (lag, over) in zip(runs, [(2.0, 0.0), (6.0, 0.25), (30.0, 1.0)], strict=True):
        run.loop_lag_ms_mean, run.loop_lag_over_10ms = lag, over
    peer = summarize("sglang-router", 0, [reply], 1.0, 0.5, None, ["w1", "w2"], config)
    rows = medians([*runs, peer])
    assert (rows[0]["loop_lag_ms_mean"], rows[0]["loop_lag_over_10ms"]) == (6.0, 0.25)
    assert rows[1]["loop_lag_ms_mean"] is None
    text = markdown(rows, [])
    assert ("ours:cache_aware, its event loop's lag over the run: mean 6.0 ms, 25% of the "
            "samples over 10 ms") in text
    assert "sglang-router, its event loop" not in text


def test_responses_bodies_carry_the_completions_text_as_input() -> None:
    from loadtest.replay import request_bodies

    requests = [TraceRequest(i, 0.0, 64, 3, prefix_key(blocks, 64))
                for i, blocks in enumerate([[1, 2, 3], [1, 2, 4]])]
    plain = request_bodies(requests, 64, 2)
    asked = request_bodies(requests, 64, 2, api="responses")
    for p, r in zip(plain, asked, strict=True):
        assert r == {"model": p["model"], "input": p["prompt"],
                     "max_output_tokens": p["max_tokens"], "temperature": 0}


def test_the_simulator_runs_prefills_as_the_fleets_workers_do() -> None:
    # The costs come from the workers' own arguments, read by their own parser; a reference
    # worker runs its prefills side by side (each its own time), or sharing its compute with
    # --prefill-shared, never one after the other.
    requests = [TraceRequest(i, 0.0, 2000, 1, prefix_key([10 * i + 1, 10 * i + 2], 2000))
                for i in range(2)]
    ends = {}
    for extra in ((), ("--prefill-shared",)):
        config = ReplayConfig(workers=1, cache_blocks=100, concurrency=2,
                              prefill_us_per_token=50.0, extra_worker_args=extra)
        assert config.sim_costs().prefill_shared is bool(extra)
        assert config.sim_costs().prefill_us_per_token == 50.0
        sim = simulated(requests, config, "round_robin", 0.5, delays=((0.0, 0.0), (0.0, 0.0)))
        ends[extra] = sim["sim_seconds"]
    from loadtest.replay_sim import live_units

    # One prompt's prefill on an engine of its own (in the replay's units: the text the
    # trace's blocks are sent as).
    alone = live_units(requests, config)[0].input_tokens * 50e-6
    assert alone > 0
    assert ends[()] == pytest.approx(alone)  # side by side
    assert ends[("--prefill-shared",)] == pytest.approx(2 * alone)  # sharing, ending together


def test_a_worker_frees_a_request_when_its_live_engine_did() -> None:
    """As above, but each live engine said when it freed the request's blocks (A 0.3 s after
    its decision, B 0.1 s after its own): B's go back to the LRU first, so C's 8 blocks evict
    B's deepest 4 and A's prompt again (D) finds all 8 of its blocks."""
    reqs, config = a_b_c_then_a()
    holds = [(0.0, 0.31), (0.0, 0.11), (0.0, 0.01), (0.0, 0.01)]
    sim = simulated(reqs, config, "round_robin", pooled=1.0, delays=holds,
                    decided_s=(0.0, 0.0001, 0.5, 0.6), cached=(0, 0, 0, 8),
                    engine_held=(0.3, 0.1, 0.005, 0.005))
    assert sim["block_hit_rate"] == pytest.approx(8 / 32)
    assert sim["same_cached"] == 1.0


def test_a_worker_lets_others_reuse_a_prompt_when_its_live_engine_had_computed_it() -> None:
    """Engines that reuse a block once computed (``--cache-reuse=computed``): A's 8 blocks
    are computed 50 ms after its decision live (its engine said so), and B, which shares A's
    first 4 blocks, is decided 20 ms after A. Live it found none of them; so does the
    simulated worker with A's live instant, where its free cost model alone had them ready."""
    a = prefix_key(range(8), 512 * 8)
    b = prefix_key([0, 1, 2, 3, 300, 301, 302, 303], 512 * 8)
    reqs = [TraceRequest(0, 0.0, 512 * 8, 1, a), TraceRequest(1, 0.0, 512 * 8, 1, b)]
    assert ReplayConfig(workers=1, cache_blocks=20).cache_reuse() == "scheduled"
    config = ReplayConfig(workers=1, cache_blocks=20, concurrency=4,
                          extra_worker_args=("--cache-reuse=computed",))
    assert config.cache_reuse() == "computed"
    holds = [(0.0, 0.06), (0.0, 0.01)]
    for computed, reused in (((0.05, 0.005), 0), ((), 4)):
        sim = simulated(reqs, config, "round_robin", pooled=1.0, delays=holds,
                        decided_s=(0.0, 0.02), cached=(0, 0), engine_computed=computed)
        assert sim["block_hit_rate"] == pytest.approx(reused / 16), computed
        assert sim["same_cached"] == (1.0 if not reused else 0.5)


def test_engine_computes_come_from_the_decision_and_the_engines_instant() -> None:
    from loadtest.replay import engine_computes

    said = [Reply(200, "w", 10, 0, 0.1, decided_at=100.0, engine_computed_at=100.125),
            Reply(200, "w", 10, 0, 0.1, decided_at=100.5, engine_computed_at=100.5)]
    assert engine_computes(said) == [0.125, 0.0]
    assert engine_computes([*said, Reply(200, "w", 10, 0, 0.1, decided_at=101.0)]) == []


def test_engine_holds_come_from_the_decision_and_the_engines_instant() -> None:
    from loadtest.replay import engine_holds

    said = [Reply(200, "w", 10, 0, 0.1, decided_at=100.0, engine_done_at=100.25),
            Reply(200, "w", 10, 0, 0.1, decided_at=100.5, engine_done_at=100.5625)]
    assert engine_holds(said) == [0.25, 0.0625]
    # A reply that did not say (a peer's, a failure): none at all.
    assert engine_holds([*said, Reply(200, "w", 10, 0, 0.1, decided_at=101.0)]) == []


def test_each_request_waits_for_its_sessions_previous_one_in_the_simulators_order() -> None:
    # Two sessions (blocks 1.. and 7..) in trace order 0, 1, 2, 3; the simulator takes them
    # at the live decision instants, in the order 1, 0, 3, 2 (positions there): each waits
    # for its session's previous request at that request's new position.
    requests = [TraceRequest(i, 0.0, 512 * len(ids), 1, prefix_key(ids, 512 * len(ids)))
                for i, ids in enumerate(([1, 2], [7, 8], [1, 2, 3], [7, 8, 9]))]
    assert session_waits(requests, [0, 1, 2, 3], timed=False) == (-1, -1, 0, 1)
    assert session_waits(requests, [1, 0, 3, 2], timed=True) == (-1, -1, 0, 1)
    assert session_waits(requests, [0, 2, 1, 3], timed=True) == (-1, 0, -1, 2)
