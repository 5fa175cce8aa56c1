"""The simulator beside a live replay: the same trace, fleet, keys and timing as a live run.

:func:`simulate_runs` runs :mod:`loadtest.sim` once per live run of a gateway policy
(:mod:`loadtest.replay`), on the live fleet's worker ids (hence its ring), the gateway's
fingerprint shape, the run's costs and concurrency, and the run's own timing
(:func:`request_delays`): each request is decided as long after its send as it was live, in
the order it was sent and no sooner after the decision before it than the gateway's CPU time
per request (:func:`decision_gap`), and counts in flight on its worker for as long as the
gateway held it there. It routes on the keys the gateway computed (:func:`gateway_keys`), so
cold prefixes land where they did live, and reports the share of requests it sent to the
worker the gateway chose (``same_worker``).

That simulation models the client (a closed loop whose next send follows a reply). When the
gateway said when it decided each request (``x-route-at``, in ``RunResult.decided_s``), the
simulator also runs without that model (``decisions``): every request decided at its live
instant, in the live order, held for its live hold, so that what remains simulated is the
routing itself and the workers' caches. Where the two disagree with live by different amounts,
the difference is the client model's; where the second disagrees, the routing or the cache
model is wrong.
"""

from __future__ import annotations

import math
import random
import statistics
import typing
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gateway.auth import TenantHasher, tenant_secret
from gateway.contracts.config import parse_value
from gateway.contracts.kv_keys import engine_namespace
from gateway.fingerprint import Namespace, PrefixKey, fingerprint
from gateway.kvevents.tokenize import PromptTokenizer
from gateway.openai_schema import parse_completion
from gateway.rebalance import action_from_json
from gateway.routing.policies import PolicyOptions
from gateway.settings import GatewaySettings
from loadtest.sessions import previous_in_session, think_times
from loadtest.sim.cluster import SimConfig, pooled_bound, simulate
from loadtest.sim.report import max_over_mean, metrics, percentile
from loadtest.traces import TraceRequest
from worker.settings import CACHE_REUSE

if TYPE_CHECKING:
    from loadtest.replay import ReplayConfig, RunResult


Overrides = dict[str, Any]  # SimConfig fields to change; "policy_options": its own changes


def sim_overrides(pairs: Sequence[str]) -> Overrides:
    """``NAME=VALUE`` pairs (``--sim-set``) as changes to the simulator's configuration: NAME
    a plain field of :class:`SimConfig` the live run did not fix (``prewarm``,
    ``rebalance_interval_s``, ``index_knows_capacity``...) or ``policy.NAME``, a field of
    the routing policy's options (``policy.volume_guard``...); VALUE read as that field's
    type, as the gateway reads its settings (:func:`gateway.contracts.config.parse_value`).
    Raises ValueError for an unknown name or an unreadable value."""
    plain = {name: kind for name, kind in typing.get_type_hints(SimConfig).items()
             if (kind in _KINDS or name in _CHOICES) and name not in _LIVE_RUN}
    policy = {name: kind for name, kind in typing.get_type_hints(PolicyOptions).items()
              if kind in _KINDS}
    out: Overrides = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        table, key = (policy, name[7:]) if name.startswith("policy.") else (plain, name)
        if not sep or key not in table:
            raise ValueError(f"--sim-set {pair!r}: NAME=VALUE with NAME one of "
                             f"{', '.join(sorted(plain))} or policy.NAME with NAME one of "
                             f"{', '.join(sorted(policy))}")
        value = parse_value(text, table[key], f"--sim-set {pair!r}")
        if table is plain and key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"--sim-set {pair!r}: {key} is one of {', '.join(_CHOICES[key])}")
        if table is policy:
            out.setdefault("policy_options", {})[key] = value
        else:
            out[key] = value
    return out


_KINDS = (bool, int, float)
# Fields of another kind that may be set, with the values they take: the engines' rule for
# reusing a block (what the fleet would have done on another engine, e.g. reuse=computed).
_CHOICES = {"reuse": CACHE_REUSE}
# What the live run fixed (its fleet, its timing): not changed after the fact.
_LIVE_RUN = frozenset({"workers", "cache_blocks", "max_running", "ring_seed", "speedup",
                       "key_blocks_per_block", "decision_gap_s", "route_delay_s",
                       "relay_delay_s", "streaming"})


def with_overrides(sim: SimConfig, overrides: Overrides) -> SimConfig:
    """``sim`` with :func:`sim_overrides`' changes."""
    top = {k: v for k, v in overrides.items() if k != "policy_options"}
    policy = overrides.get("policy_options", {})
    return replace(sim, policy_options=replace(sim.policy_options, **policy), **top)


def gateway_keys(requests: Sequence[TraceRequest], config: ReplayConfig,
                 model: str) -> tuple[PrefixKey, ...]:
    """The keys a live gateway with the default settings computes for the replay's bodies of
    ``requests`` (:func:`loadtest.replay.request_bodies`) when it fingerprints them under
    ``model`` (its ``model@version``, ``/admin/workers`` ``namespaces``) for a request no
    key identified: the same ring anchors and checkpoints, so the simulator places cold
    prefixes where the gateway did."""
    from loadtest.replay import request_bodies  # the replay imports this module

    settings = GatewaySettings()
    normalize, opts = settings.normalize_options(), settings.fingerprint_options()
    keys = []
    for body in request_bodies(requests, config.block_chars, config.max_tokens,
                               invisible_edits=config.invisible_edits,
                               lines=config.text_lines):
        parsed = parse_completion(body, normalize)
        keys.append(fingerprint(parsed.fingerprint_text,
                                Namespace(model=model, cache_salt=parsed.cache_salt), opts))
    return tuple(keys)


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


_MASK_63 = (1 << 63) - 1  # the simulated cache stores block ids as signed 64-bit tokens


def token_units(requests: Sequence[TraceRequest],
                config: ReplayConfig) -> tuple[list[TraceRequest], tuple[PrefixKey, ...]]:
    """With token-exact keys (``config.tokenizer_file``): the trace as its workers cache it,
    and the keys the gateway routes it on. Each body is keyed as an open gateway keys it (the
    fleet's tokenizer and block size, the gateway's limits, its cache namespace): that key is
    the route key; its token blocks are the request's cache blocks and its token count the
    prompt's length, as the workers see them."""
    from loadtest.replay import request_bodies  # the replay imports this module

    settings = GatewaySettings(tokenizer_file=config.tokenizer_file,
                               kv_block_size=config.block_tokens)
    opts = settings.tokenizer_options()
    assert opts is not None
    tokenizer = PromptTokenizer(opts)
    hasher = TenantHasher(tenant_secret("", keys_configured=False, shared_store=False))
    normalize = settings.normalize_options()
    units, keys = [], []
    try:
        bodies = request_bodies(requests, config.block_chars, config.max_tokens,
                                invisible_edits=config.invisible_edits,
                                lines=config.text_lines)
        for r, body in zip(requests, bodies, strict=True):
            parsed = parse_completion(body, normalize)
            salt = engine_namespace(hasher.namespace("", parsed.cache_salt), parsed.cache_salt)
            out = tokenizer.key_here(parsed.body, chat=False, salt=salt)
            if out is None:
                raise ValueError(f"request {r.index}: the tokenizer cannot key its prompt")
            keys.append(out.key)
            units.append(TraceRequest(
                r.index, r.arrival_s, out.tokens, min(r.output_tokens, config.max_tokens),
                PrefixKey(tuple(k & _MASK_63 for k in out.key.blocks), out.key.anchor,
                          out.tokens)))
    finally:
        tokenizer.close()
    return units, tuple(keys)


def delay_factors(run: RunResult) -> tuple[float, ...]:
    """Each request's live latency over the run's mean."""
    mean = statistics.fmean(run.latencies_ms) if run.latencies_ms else 0.0
    return tuple(ms / mean for ms in run.latencies_ms) if mean > 0 else ()


def request_delays(run: RunResult, config: ReplayConfig) -> tuple[tuple[float, float], ...]:
    """Per request, in trace order: (seconds from the client's send to the gateway's
    decision, seconds the gateway held it from the decision to the worker's reply), the
    simulator's ``SimConfig.request_delays``.

    Measured where the gateway said (its ``Server-Timing`` ``upstream``, in
    ``run.upstream_ms``): the hold, and the rest of the client's latency before it (which
    puts the reply's way back to the client, 1.5-2 ms on average on one machine, before the
    decision too). A report without it (from before the header) gets the run's mean split
    (:func:`live_timing`) scaled by each request's latency over the mean: a guess that moves
    the decision instants of slow requests as much as their holds."""
    held = run.upstream_ms
    if held and len(held) == len(run.latencies_ms):
        return tuple((max(0.0, total - hold) / 1e3, hold / 1e3)
                     for total, hold in zip(run.latencies_ms, held, strict=True))
    route, relay = live_timing(run, config)
    return tuple((route * f, relay * f) for f in delay_factors(run))


def start_scrapes(scrapes: Sequence[Mapping[str, Any]],
                  decided_s: Sequence[float] = ()) -> tuple[tuple[str, dict[str, float]], ...]:
    """The engine scrapes a live run's gateway made before its first decision (its start-up
    probe round, after the harness warmed the workers), the last one per worker: the state the
    run's fleet began in, for ``SimConfig.start_scrapes``. Each scrape's ``decided_s`` is on
    the clock of the run's decision instants (the first decision at 0 when ``decided_s`` is
    not given)."""
    first = min(decided_s, default=0.0)
    last: dict[str, dict[str, float]] = {}
    for x in sorted(scrapes, key=lambda x: float(x["decided_s"])):
        if float(x["decided_s"]) <= first:
            last[str(x["worker"])] = dict(x["metrics"])
    return tuple(last.items())


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


# The simulated engines' time to first token (ms) rides along: the part of a live request's
# latency that the workers' cost model makes, without the gateway's, the client's and the
# sockets' time.
SIM_KEYS = ("block_hit_rate", "hit_over_bound", "routed_max_over_mean",
            "requests_max_over_mean", "prefill_max_over_mean", "ttft_p50_ms", "ttft_p99_ms")


def simulated(requests: Sequence[TraceRequest], config: ReplayConfig, policy: str,
              pooled: float, timing: tuple[float, float] = (0.0, 0.0),
              worker_ids: Sequence[str] = (),
              delays: Sequence[tuple[float, float]] = (),
              keys: Sequence[PrefixKey] = (),
              routed_to: Sequence[str] = (), decision_gap_s: float = 0.0,
              decided_s: Sequence[float] = (), overrides: Overrides | None = None,
              units: Sequence[TraceRequest] = (),
              cached: Sequence[int] = (),
              rebalanced: Sequence[Mapping[str, Any]] | None = None,
              scrapes: Sequence[Mapping[str, Any]] = (),
              prewarmed: Sequence[str] = (),
              engine_held: Sequence[float] = (),
              engine_computed: Sequence[float] = (),
              copy_hold_s: float = 0.0,
              start_state: Sequence[tuple[str, Mapping[str, float]]] = ()) -> dict[str, Any]:
    """The simulator on the live run's fleet (``worker_ids``: its ids, hence its ring), costs,
    concurrency, keys (the gateway's own, :func:`gateway_keys`, else the trace's in the
    gateway's shape) and timing: each request's own ``delays`` (:func:`request_delays`), or
    the same ``timing`` for all (:func:`live_timing`), decisions at least
    ``decision_gap_s`` apart (:func:`decision_gap`). With the live run's workers per
    request (``routed_to``), ``same_worker`` is the share of requests the simulator sent
    where the gateway did; with the blocks each request's live worker reported reusing
    (``cached``), ``same_cached`` is the share of requests whose simulated worker reused as
    many. With the seconds from each decision to the live engine freeing the request's
    blocks (``engine_held``, :attr:`RunResult.engine_held_s`), the simulated workers free
    them then; with those to its having computed the prompt (``engine_computed``), they
    count its blocks computed then (reused without waiting; under ``--cache-reuse
    computed``, reused at all only from then on). A session copy keeps its
    worker from another copy for ``copy_hold_s`` from its decision at least (the live run's
    mean, :attr:`RunResult.copy_ms_mean`). From the client's timing the fleet begins as the
    live one did (``start_state``: :func:`start_scrapes`), its engines' histograms as the
    gateway's start-up probes read them.

    With the gateway's own decision instants (``decided_s``, per request in trace order), the
    client is not simulated at all: each request is decided at its live instant, in the live
    order, and held for its live hold (``delays``' second entry), so that only the routing
    and the workers' caches are simulated (``timing`` is then ``"decisions"``).

    ``overrides`` (:func:`sim_overrides`) changes the simulator's configuration: at the
    decision instants, what the gateway would have done otherwise with the same arrivals
    (later requests keep their live timing: an approximation once the routing parts).
    There, the live run's rebalance actions (``rebalanced``, each with its ``decided_s``) are
    applied at their instants instead of the simulator's own rebalancer rounds, whose clock
    is not the live gateway's, and so are the engine scrapes its health probes routed on
    (``scrapes``, each with its ``decided_s``), and its pre-warms at the decisions that
    placed them (``prewarmed``: per request, the worker; unless ``overrides`` sets
    ``prewarm``)."""
    units = list(units) or live_units(requests, config)
    tokens = bool(config.tokenizer_file)  # units and keys in the engine's token blocks
    order = list(range(len(units)))
    timed = bool(decided_s) and len(decided_s) == len(units) == len(delays)
    if timed:
        order.sort(key=lambda i: (decided_s[i], i))
        units = [replace(units[i], arrival_s=decided_s[i]) for i in order]
        delays = [(0.0, delays[i][1]) for i in order]
        keys = [keys[i] for i in order] if len(keys) == len(order) else ()
        engine_held = ([engine_held[i] for i in order] if len(engine_held) == len(order)
                       else ())
        engine_computed = ([engine_computed[i] for i in order]
                           if len(engine_computed) == len(order) else ())
    prewarm_log: tuple[str, ...] = ()
    if timed and len(prewarmed) == len(order) and "prewarm" not in (overrides or {}):
        prewarm_log = tuple(prewarmed[i] for i in order)
    logged = None  # with --sim-set rebalance_interval_s=..., the simulator's own rounds
    if (timed and rebalanced is not None and all("decided_s" in a for a in rebalanced)
            and "rebalance_interval_s" not in (overrides or {})):
        logged = tuple((float(a["decided_s"]), action) for a in rebalanced
                       if (action := action_from_json(a)) is not None)
    think = (think_times(requests, previous_in_session(requests), config.think_scale)
             if config.session_order and config.think_scale > 0 else [])
    sim = SimConfig(
        workers=config.workers, cache_blocks=config.cache_blocks, policy=policy,
        mode="replay" if timed else "sequential",
        concurrency=None if timed else config.concurrency, max_running=config.max_running,
        costs=config.sim_costs(), serial_prefill=False,  # as the reference worker runs them
        index_knows_capacity=config.report_cache_size,
        key_blocks_per_block=0 if tokens else config.block_chars // 64,
        block_tokens=config.block_tokens,
        private_blocks=1 if tokens else 0,
        route_delay_s=timing[0], relay_delay_s=timing[1], worker_names=tuple(worker_ids),
        request_delays=tuple(delays), route_keys=tuple(keys),
        engine_holds=tuple(engine_held) if len(engine_held) == len(units) else (),
        engine_computed=tuple(engine_computed) if len(engine_computed) == len(units) else (),
        decision_gap_s=0.0 if timed else decision_gap_s, rebalance_log=logged,
        scrape_log=tuple((float(x["decided_s"]), str(x["worker"]), dict(x["metrics"]),
                          x.get("own")) for x in scrapes) if timed else (),
        start_scrapes=() if timed else tuple(start_state),
        prewarm_log=prewarm_log, copy_hold_s=copy_hold_s,
        priority_engines=config.priority_engines(),
        reuse=config.cache_reuse(),
        after=session_waits(requests, order, timed) if config.session_order else (),
        think_s=tuple(think[pos] for pos in order) if think else (),
    )
    result = simulate(units, with_overrides(sim, overrides) if overrides else sim)
    assignments = [""] * len(order)
    reused = [-1] * len(order)
    for pos, worker, blocks in zip(order, result.assignments, result.reused, strict=True):
        assignments[pos] = worker
        reused[pos] = blocks
    m = metrics(result, pooled)
    m["ttft_p50_ms"] = percentile(result.ttft_s, 50) * 1e3
    m["ttft_p99_ms"] = percentile(result.ttft_s, 99) * 1e3
    # As the live run counts it: blocks routed per worker (the simulator's own report counts
    # requests); requests as requests_max_over_mean.
    m["routed_max_over_mean"] = max_over_mean([w.blocks for w in result.per_worker])
    m["requests_max_over_mean"] = max_over_mean([w.routed for w in result.per_worker])
    same = (sum(a == b for a, b in zip(assignments, routed_to, strict=True))
            / len(routed_to) if routed_to and len(routed_to) == len(assignments)
            else None)
    same_cached = (sum(a == b for a, b in zip(reused, cached, strict=True)) / len(cached)
                   if cached and len(cached) == len(reused) else None)
    return {"router": f"ours:{policy}", "pooled_bound": pooled,
            **{k: m[k] for k in SIM_KEYS},
            "same_worker": same, "same_cached": same_cached,
            "timing": "decisions" if timed else "client",
            "route_delay_ms": timing[0] * 1e3, "relay_delay_ms": timing[1] * 1e3,
            "sim_seconds": result.sim_seconds, "reasons": dict(result.reasons),
            "prewarms": result.prewarms, "prewarms_used": result.prewarms_used,
            "rebalance": dict(result.rebalance)}


def session_waits(requests: Sequence[TraceRequest], order: Sequence[int],
           timed: bool) -> tuple[int, ...]:
    """Per request as the simulator gets them (``order``: their trace positions), the one
    before it in its session (-1: none), as the replay's --session-order waits for it. At the
    decision instants too: a request is decided at its live instant or once its session's
    previous one was answered in the simulation, whichever is later. (Otherwise a turn that
    the simulated engine answered a millisecond later than the live one found its history
    uncomputed, and its miss, recomputed, made the next turn late too: one run of three
    fell 0.0155 below live on agent sessions, its misses all on one worker.)"""
    before = previous_in_session(requests)
    if not timed:
        return tuple(before)
    at = {pos: k for k, pos in enumerate(order)}
    return tuple(at[before[pos]] if before[pos] >= 0 else -1 for pos in order)


def agreement(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Simulated minus live, run by run, the largest of each (signed, as large in magnitude
    as any): ``hit`` (hit over the pooled bound) and ``balance`` (routed max/mean), for the
    client model (``client``) and at the decision instants (``decisions``, when every run
    has them)."""
    def largest(pairs: list[tuple[float, float]]) -> float:
        return max((sim - live for sim, live in pairs), key=abs, default=0.0)

    out: dict[str, dict[str, float]] = {}
    views = ["client"]
    if runs and all("decisions" in r for r in runs):
        views.append("decisions")
    for name in views:
        sims = [r if name == "client" else r["decisions"] for r in runs]
        out[name] = {
            "hit": largest([(sim["hit_over_bound"], r["live"]["hit_over_bound"])
                            for sim, r in zip(sims, runs, strict=True)]),
            "balance": largest([(sim["routed_max_over_mean"], r["live"]["routed_max_over_mean"])
                                for sim, r in zip(sims, runs, strict=True)]),
        }
    return out


def decision_gap(run: RunResult) -> float:
    """Seconds between two of the gateway's decisions at least: its CPU time per request
    (one event loop works on one request at a time), 0 where it was not measured.

    Without it, requests that reach the gateway together are decided at one instant in the
    simulator, and among holders in the same state the tie goes to ring order every time;
    live, decisions are a fraction of a millisecond apart, and the index's decayed request
    counts break such ties toward the holder used least recently (on RAG documents the
    simulator's balance was 0.12 worse than live's without it)."""
    return run.cpu_s_per_1k / 1000.0 if run.cpu_s_per_1k else 0.0


# Spread of the decision instants between simulator draws: each request's delays times
# exp(N(0, SIM_JITTER)). On 1,000-request runs routed max/mean moves by ~0.07 (one standard
# deviation) under such jitter. With each request's timing measured, the unjittered draw is
# the faithful one (jittered draws made RAG's balance 0.05 worse than live's), so the replay
# runs one draw unless asked for more.
SIM_JITTER = 0.1


def simulate_draws(requests: Sequence[TraceRequest], config: ReplayConfig, run: RunResult,
                   pooled: float, draws: int = 1,
                   keys: Sequence[PrefixKey] = (),
                   overrides: Overrides | None = None,
                   units: Sequence[TraceRequest] = ()) -> dict[str, Any]:
    """The simulator on one live run's fleet, ``keys`` and timing: the mean of ``draws``
    runs, the first with each request's live timing, the others with it jittered
    (:data:`SIM_JITTER`); ``same_worker`` is the first one's. With the run's decision
    instants, ``decisions`` holds one more run at those instants (:func:`simulated`)."""
    policy = run.router.partition(":")[2]
    timing = live_timing(run, config)
    copy_hold_s = run.copy_ms_mean / 1e3 if run.copy_ms_mean else 0.0
    delays = request_delays(run, config)
    start = start_scrapes(run.engine_scrapes, run.decided_s)
    samples = []
    for draw in range(max(1, draws)):
        rng = random.Random(f"{run.repeat}:{draw}")
        jittered = [(wait * math.exp(rng.gauss(0.0, SIM_JITTER)),
                     hold * math.exp(rng.gauss(0.0, SIM_JITTER)))
                    for wait, hold in delays] if draw else delays
        samples.append(simulated(requests, config, policy, pooled, timing, run.worker_ids,
                                 jittered, keys, run.routed_to, decision_gap(run),
                                 overrides=overrides, units=units,
                                 engine_held=run.engine_held_s,
                                 engine_computed=run.engine_computed_s, copy_hold_s=copy_hold_s,
                                 start_state=start))
    out = dict(samples[0])
    for key in SIM_KEYS:
        out[key] = statistics.fmean(s[key] for s in samples)
    out["draws"] = len(samples)
    out["live"] = {"hit_over_bound": run.hit_over_bound,
                   "routed_max_over_mean": run.routed_max_over_mean}
    if run.decided_s:
        decided = simulated(requests, config, policy, pooled, timing, run.worker_ids, delays,
                            keys, run.routed_to, decided_s=run.decided_s, overrides=overrides,
                            units=units, cached=run.cached_blocks, rebalanced=run.rebalance,
                            scrapes=run.engine_scrapes, prewarmed=run.prewarmed_to,
                            engine_held=run.engine_held_s,
                            engine_computed=run.engine_computed_s, copy_hold_s=copy_hold_s)
        out["decisions"] = {k: decided[k] for k in (*SIM_KEYS, "same_worker", "same_cached",
                                                    "prewarms", "prewarms_used")}
    return out


def simulate_runs(requests: Sequence[TraceRequest], config: ReplayConfig,
                  results: Sequence[RunResult], draws: int = 1,
                  overrides: Overrides | None = None) -> list[dict[str, Any]]:
    """Per gateway policy: the simulator on each live run, with that run's timing
    (:func:`simulate_draws`), and the median of each metric over the runs (``runs`` holds
    each one)."""
    pooled = pooled_bound(requests, config.workers * config.cache_blocks)
    by_policy: dict[str, list[dict[str, Any]]] = {}
    keys: dict[str, tuple[PrefixKey, ...]] = {}  # per model@version the gateway keyed under
    units: list[TraceRequest] = []
    if config.tokenizer_file and any(r.router.startswith("ours:") for r in results):
        units, keys[""] = token_units(requests, config)  # token keys: no model in them
    for run in results:
        if run.router.startswith("ours:"):
            model = "" if config.tokenizer_file else run.namespace_model
            if model and model not in keys:
                keys[model] = gateway_keys(requests, config, model)
            by_policy.setdefault(run.router[5:], []).append(
                simulate_draws(requests, config, run, pooled, draws, keys.get(model, ()),
                               overrides, units))
    out = []
    for policy, runs in by_policy.items():
        row: dict[str, Any] = {"router": f"ours:{policy}", "repeats": len(runs),
                               "pooled_bound": pooled, "overrides": dict(overrides or {})}
        for key in SIM_KEYS:
            row[key] = statistics.median(r[key] for r in runs)
        same = [r["same_worker"] for r in runs if r.get("same_worker") is not None]
        row["same_worker"] = statistics.median(same) if len(same) == len(runs) else None
        if all("decisions" in r for r in runs):  # every run said when it decided
            row["decisions"] = {key: statistics.median(r["decisions"][key] for r in runs)
                                for key in SIM_KEYS}
            for share in ("same_worker", "same_cached"):
                same = [r["decisions"][share] for r in runs
                        if r["decisions"].get(share) is not None]
                row["decisions"][share] = (statistics.median(same) if len(same) == len(runs)
                                           else None)
        row["agreement"] = agreement(runs)
        row["runs"] = runs
        out.append(row)
    return out
