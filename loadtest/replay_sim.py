"""The simulator beside a live replay: the same trace, fleet, keys and timing as a live run.

:func:`simulate_runs` runs :mod:`loadtest.sim` once per live run of a gateway policy
(:mod:`loadtest.replay`), on the live fleet's worker ids (hence its ring), the gateway's
fingerprint shape, the run's costs and concurrency, and the run's own timing: each request
takes as long as it did live (:func:`delay_factors`), split into the wait before the decision
and the gateway's hold by the gateway's sampled count in flight (:func:`live_timing`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.fingerprint import PrefixKey
from loadtest.sim.cluster import SimConfig, pooled_bound, simulate
from loadtest.sim.report import max_over_mean, metrics
from loadtest.traces import TraceRequest

if TYPE_CHECKING:
    from loadtest.replay import ReplayConfig, RunResult


def live_units(requests: Sequence[TraceRequest], config: ReplayConfig) -> list[TraceRequest]:
    """The trace as the live run sends it, for the simulator: every block is ``block_tokens``
    worker tokens and ``block_chars`` characters, decode capped at ``max_tokens``."""
    bt = config.block_tokens
    return [
        TraceRequest(r.index, r.arrival_s, len(r.blocks) * bt, min(r.output_tokens,
                                                                   config.max_tokens),
                     PrefixKey(r.key.blocks, r.key.anchor, len(r.blocks) * config.block_chars))
        for r in requests
    ]


def delay_factors(run: RunResult) -> tuple[float, ...]:
    """Each request's live latency over the run's mean: the simulator's per-request factor on
    its delays, so that every request takes as long as it did live (order of completions
    included)."""
    mean = statistics.fmean(run.latencies_ms) if run.latencies_ms else 0.0
    return tuple(ms / mean for ms in run.latencies_ms) if mean > 0 else ()


def live_timing(run: RunResult, config: ReplayConfig) -> tuple[float, float]:
    """``(route_delay_s, relay_delay_s)`` of a live run, for the simulator. By Little's law a
    request spends the mean client latency ``L`` in flight at throughput ``X = requests /
    seconds``; the gateway's mean count in flight ``I`` (decided, not yet settled) makes
    ``I / X`` of it the gateway's hold (decision to settlement, the worker's time included) and
    the rest the wait before the decision. Without a sample, the gateway holds it all."""
    if run.seconds <= 0 or run.requests == 0:
        return 0.0, 0.0
    throughput = run.requests / run.seconds
    latency = run.mean_latency_ms / 1e3
    inflight = config.concurrency if run.gateway_inflight is None else run.gateway_inflight
    held = min(latency, inflight / throughput)
    return latency - held, held


SIM_KEYS = ("block_hit_rate", "hit_over_bound", "routed_max_over_mean",
            "requests_max_over_mean", "prefill_max_over_mean")


def simulated(requests: Sequence[TraceRequest], config: ReplayConfig, policy: str,
              pooled: float, timing: tuple[float, float] = (0.0, 0.0),
              worker_ids: Sequence[str] = (), factors: Sequence[float] = ()) -> dict[str, Any]:
    """The simulator on the live run's fleet (``worker_ids``: its ids, hence its ring), costs,
    concurrency, keys and ``timing`` (:func:`live_timing`, per request scaled by ``factors``:
    :func:`delay_factors`)."""
    sim = SimConfig(
        workers=config.workers, cache_blocks=config.cache_blocks, policy=policy,
        mode="sequential", concurrency=config.concurrency, max_running=config.max_running,
        costs=config.sim_costs(), index_knows_capacity=config.report_cache_size,
        key_blocks_per_block=config.block_chars // 64,
        route_delay_s=timing[0], relay_delay_s=timing[1], worker_names=tuple(worker_ids),
        delay_factors=tuple(factors),
    )
    result = simulate(live_units(requests, config), sim)
    m = metrics(result, pooled)
    # As the live run counts it: blocks routed per worker (the simulator's own report counts
    # requests); requests as requests_max_over_mean.
    m["routed_max_over_mean"] = max_over_mean([w.blocks for w in result.per_worker])
    m["requests_max_over_mean"] = max_over_mean([w.routed for w in result.per_worker])
    return {"router": f"ours:{policy}", "pooled_bound": pooled,
            **{k: m[k] for k in SIM_KEYS},
            "route_delay_ms": timing[0] * 1e3, "relay_delay_ms": timing[1] * 1e3,
            "sim_seconds": result.sim_seconds, "reasons": dict(result.reasons),
            "rebalance": dict(result.rebalance)}


# Spread of the decision instants between simulator draws: each request's delays times
# exp(N(0, SIM_JITTER)). On 1,000-request runs routed max/mean moves by ~0.07 (one standard
# deviation) under such jitter, in the simulator as live, so one draw is one sample of it.
SIM_JITTER = 0.1


def simulate_draws(requests: Sequence[TraceRequest], config: ReplayConfig, run: RunResult,
                   pooled: float, draws: int = 1) -> dict[str, Any]:
    """The simulator on one live run's fleet and timing: the mean of ``draws`` runs, the first
    with each request's live latency, the others with it jittered (:data:`SIM_JITTER`)."""
    policy = run.router.partition(":")[2]
    timing = live_timing(run, config)
    factors = delay_factors(run)
    samples = []
    for draw in range(max(1, draws)):
        rng = random.Random(f"{run.repeat}:{draw}")
        jittered = [f * math.exp(rng.gauss(0.0, SIM_JITTER)) for f in factors] if draw \
            else factors
        samples.append(simulated(requests, config, policy, pooled, timing, run.worker_ids,
                                 jittered))
    out = dict(samples[0])
    for key in SIM_KEYS:
        out[key] = statistics.fmean(s[key] for s in samples)
    out["draws"] = len(samples)
    return out


def simulate_runs(requests: Sequence[TraceRequest], config: ReplayConfig,
                  results: Sequence[RunResult], draws: int = 1) -> list[dict[str, Any]]:
    """Per gateway policy: the simulator on each live run, with that run's timing
    (:func:`simulate_draws`), and the median of each metric over the runs (``runs`` holds
    each one)."""
    pooled = pooled_bound(requests, config.workers * config.cache_blocks)
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for run in results:
        if run.router.startswith("ours:"):
            by_policy.setdefault(run.router[5:], []).append(
                simulate_draws(requests, config, run, pooled, draws))
    out = []
    for policy, runs in by_policy.items():
        row: dict[str, Any] = {"router": f"ours:{policy}", "repeats": len(runs),
                               "pooled_bound": pooled}
        for key in SIM_KEYS:
            row[key] = statistics.median(r[key] for r in runs)
        row["runs"] = runs
        out.append(row)
    return out
