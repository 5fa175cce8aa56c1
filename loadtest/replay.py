"""Live trace replay: reference workers, the gateway and (optionally) peer routers, side by side.

``python -m loadtest replay (--trace PATH | --workload W) --workers N --cache-blocks C
[--concurrency K] [--policy P|all] [--gateway URL] [--gateway-variant LABEL=ARGS] [--peers]
[--peer-variant PEER[LABEL]=ARGS] [--no-report-cache-size] [--repeat R] [--own-core]
[--worker-nice N] [--simulate] [--json]``

N reference workers start on loopback (``python -m worker``, simulated engine) with the
``chars`` tokenizer (one token per 4 characters) and KV blocks of ``--block-chars / 4`` tokens,
so one trace block, synthesized as ``--block-chars`` characters of text
(:class:`loadtest.textgen.TextSynth`), is exactly one cache block and a worker holds exactly
``C`` trace blocks. The trace is replayed closed-loop, in order, with ``K`` requests in flight
(one ``/v1/completions`` call per trace request, ``--max-tokens`` output tokens) through each
router in turn: the gateway with each ``--policy``, then each ``--gateway-variant``: the gateway
with arguments of its own added last (a routing setting to compare side by side), reported as
``ours[LABEL]:POLICY`` (an argument ``@DIR`` runs that variant's gateway from the checkout in
DIR: a change of code beside the code before it), then, with ``--peers``, sglang-router and
smg in cache_aware mode (:mod:`loadtest.peers`), and each ``--peer-variant``: a peer with
arguments of its own (its balance thresholds, say), reported as ``PEER[LABEL]``. Between
routers every worker's cache is flushed (``POST /admin/flush``), so each router starts from
the same empty fleet; the workers keep their ports, so every gateway run has the same ring.
Before the first router, each fresh worker answers a few of the trace's first requests sent to
it directly (``Fleet.warm``), so that no router meets workers answering their first requests.
``--repeat R`` restarts the whole fleet R times and reports the median of each metric per
router, and each router against the first gateway run repeat by repeat (:mod:`loadtest.paired`:
the median of the per-repeat differences, with a sign test; ``paired`` in the JSON), and each
router's latency by the kind of request, with the requests that make its p99
(:mod:`loadtest.tails`; ``tails`` in the JSON). The routers take turns at going first: repeat
``r`` runs the list above rotated by ``r``, so that what the order of runs on one fleet does
(the second router meets workers and a machine that the first warmed) falls on each router
alike, not always on the variants and the peers.

Per router, from what the workers report in every reply (``x-cache-*``), as
:mod:`loadtest.simulate` reports it: ``block_hit_rate``, ``pooled_bound`` (one LRU cache of all
workers' blocks, the same sequence), ``hit_over_bound``, ``routed_max_over_mean`` (blocks routed
per worker), ``prefill_max_over_mean`` (uncached blocks per worker), latency ``p50_ms`` /
``p99_ms`` (whole request, client side; for our gateway also split by its ``Server-Timing``
into ``gateway_p50_ms`` / ``gateway_p99_ms``, its own time, and ``upstream_p50_ms`` /
``upstream_p99_ms``, the worker's), and ``cpu_s_per_1k``: the router's user + system
CPU seconds per 1,000 requests (``/proc``; its process and descendants, so ``--procs N``
counts all of them); for our gateway also ``loop_lag_ms_mean`` and ``loop_lag_over_10ms``, its
event loop's lag over the run (:mod:`loadtest.gateway_lag`). ``--simulate`` also runs the
simulator after each live run of a gateway policy, with the same fleet, costs, concurrency,
keys and ring, and with each request's own timing from that run (:mod:`loadtest.replay_sim`;
with ``--sim-draws N`` also N - 1 times with the timing jittered, and the mean is reported),
and reports the median over the live runs per policy (``simulated`` in the JSON, each run
under ``runs``; ``same_worker``: the share of requests the simulator sent to the worker the
gateway chose; at the decision instants also ``same_cached``: the share whose simulated worker
reused as many blocks as the live worker reported).
``--resimulate REPORT`` re-runs only the simulator against the live runs of a saved ``--json``
report; ``--sim-set NAME=VALUE`` simulates with a change (``prewarm=false``,
``policy.volume_guard=1.1``): at the gateway's decision instants, what the gateway would have
done otherwise on the same live arrivals. For the trace itself,
``sticky_balance`` (:mod:`loadtest.sessions`): how many sessions it has and the routed max/mean
that no router keeping each session on one worker can beat.

Experiments for the telemetry-driven correction of the gateway's index: ``--restart-worker I@T``
restarts worker I T seconds into every gateway run (its cache empties; down long enough for the
gateway's probes to see it), ``--restart-in-place I@T`` makes it look restarted without being
down (``POST /admin/restart``: cache empty, counters at zero, a new start stamp on its replies),
``--flush-worker I@T`` empties its cache without a restart (nothing but the hit telemetry tells
the gateway);
``--misreport-worker I`` makes worker I report twice its real cache size. ``--timeline DIR``
writes the per-worker hit rate and mispredictions over time (:mod:`loadtest.timeline`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.routing.policies import POLICY_NAMES
from gateway.settings import GatewaySettings
from infra.local import LocalCluster, stop_processes
from infra.procs import checkout_in, from_checkout
from loadtest import gateway_lag
from loadtest.bench_gateway import (
    MODEL,
    Reply,
    free_port_block,
    percentile,
    reason_kind,
    replay,
    start_server,
    wait_all_workers_up,
)
from loadtest.cpu_pin import own_core
from loadtest.harness import interpreter
from loadtest.paired import markdown as paired_markdown
from loadtest.paired import paired
from loadtest.peers import (
    PEERS,
    PeerUnavailableError,
    base_peer,
    gateway_log_args,
    peer_variant,
    proc_tree_cpu_s,
    running_peer,
)
from loadtest.replay_sim import Overrides, sim_overrides, simulate_runs
from loadtest.sessions import previous_in_session, sticky_balance, think_times
from loadtest.sim.cluster import pooled_bound
from loadtest.sim.report import max_over_mean
from loadtest.simulate import DEFAULT_TRACE
from loadtest.tails import RouterTails, tails
from loadtest.tails import markdown as tails_markdown
from loadtest.textgen import LINE_WORDS, TextSynth, invisible_edit
from loadtest.timeline import timeline, write_timeline
from loadtest.trace_workloads import TRACE_WORKLOADS, workload_trace
from loadtest.traces import TraceRequest, read_mooncake
from loadtest.workloads import COMPLETIONS_PATH, LiveSpec, trace_body
from worker.engines.sim import SimCosts
from worker.settings import parse_settings as parse_worker_settings

HOST = "127.0.0.1"
# The path each --api sends to.
API_PATHS = {"completions": COMPLETIONS_PATH, "responses": "/v1/responses"}
# Many Python servers starting at once on a small shared machine take a while.
START_TIMEOUT_S = 120.0
# An engine scrape the gateway routed on: its metrics, and the requests the gateway had in
# flight at that worker then (None: the gateway did not say).
Scrape = tuple[dict[str, float], int | None]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    workers: int
    cache_blocks: int
    concurrency: int = 64
    block_chars: int = 64
    max_tokens: int = 1
    prefill_us_per_token: float = 0.0
    cached_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    max_running: int = 32
    report_cache_size: bool = True
    misreport_worker: int | None = None
    restart_worker: tuple[int, float] | None = None
    flush_worker: tuple[int, float] | None = None
    restart_in_place: tuple[int, float] | None = None
    # Each request waits for the answer to its session's previous one (loadtest.sessions), as
    # an agent or a chat user does; False: the trace's order alone, so that turns of one
    # session may overlap.
    session_order: bool = True
    # With session_order: a request waits this times the trace's time between it and its
    # session's previous request after that one's answer (loadtest.sessions.think_times: an
    # agent's think time or tool call); 0: none, the next turn leaves at the answer.
    think_scale: float = 0.0
    bucket_s: float = 2.0
    timeout_s: float = 300.0
    extra_worker_args: tuple[str, ...] = ()
    # Token-exact mode: workers and gateways tokenize with this tokenizer.json (engine blocks
    # of block_tokens tokens); with kv_events the workers publish their KV events and each
    # gateway policy also runs as "ours+events:<policy>" (the events alone) and
    # "ours+hybrid:<policy>" (the modelled index corrected by them).
    tokenizer_file: str = ""
    kv_events: bool = False
    # Share of requests whose prompt carries one invisible edit (the block bound ignores it).
    invisible_edits: float = 0.0
    # The synthesized text laid out in lines (loadtest.textgen.LINE_WORDS words a line), so
    # that an invisible edit may be trailing spaces on an inner line.
    text_lines: bool = False
    # Sample whether two processes of our gateway (--procs N) would route a request alike.
    agreement: bool = False
    # Every router logs each request as it does by default (ours one JSON access line, the
    # peers at --log-level info); otherwise none does (loadtest.peers.gateway_log_args).
    request_logs: bool = False
    # Each router alone on one CPU while it is measured, this process (the client) and the
    # workers on the others (loadtest.cpu_pin), as a router runs where it is deployed.
    own_core: bool = False
    # The workers' niceness (0: as the client's): a positive value lets a router that is
    # runnable go before them, as where the engines run on hosts of their own.
    worker_nice: int = 0
    # What each trace request is sent as: a completions request (its text as the prompt) or
    # a Responses API request (its text as the input).
    api: str = "completions"

    @property
    def path(self) -> str:
        return API_PATHS[self.api]

    @property
    def block_tokens(self) -> int:
        return self.block_chars // 4

    def worker_args(self) -> tuple[str, ...]:
        tokenizer = (("--tokenizer-file", self.tokenizer_file) if self.tokenizer_file
                     else ("--tokenizer", "chars"))
        return (
            *tokenizer, "--block-size", str(self.block_tokens),
            "--max-running", str(self.max_running),
            "--prefill-us-per-token", str(self.prefill_us_per_token),
            "--prefill-us-per-cached-token", str(self.cached_us_per_token),
            "--decode-ms-per-token", str(self.decode_ms_per_token),
            "--max-model-len", "1000000",
            *(() if self.report_cache_size else ("--no-report-cache-size",)),
            *self.extra_worker_args,
        )

    def priority_engines(self) -> bool:
        """Whether the fleet's workers run priority scheduling (``--worker-arg
        --scheduling-policy=priority``), read from their own arguments by their own parser."""
        return parse_worker_settings(self.worker_args()).scheduling_policy == "priority"

    def cache_reuse(self) -> str:
        """When the fleet's workers let others reuse a request's blocks (``--worker-arg
        --cache-reuse=RULE``), read from their own arguments by their own parser."""
        return parse_worker_settings(self.worker_args()).cache_reuse

    def sim_costs(self) -> SimCosts:
        """The costs the fleet's workers simulate, read from their own arguments by their own
        parser (``--worker-arg=--prefill-shared`` included)."""
        return SimCosts.of(parse_worker_settings(self.worker_args()))


@dataclass(slots=True)
class RunResult:
    router: str
    repeat: int
    requests: int
    errors: int
    block_hit_rate: float
    pooled_bound: float
    hit_over_bound: float
    routed_max_over_mean: float
    requests_max_over_mean: float
    prefill_max_over_mean: float
    p50_ms: float
    p99_ms: float
    cpu_s_per_1k: float | None
    seconds: float
    # Share of responses whose cached tokens the gateway predicted exactly (/admin/workers),
    # and the shares it predicted more (over) and fewer (under) than the worker reused, with
    # the mean tokens off of each.
    exact_predictions: float | None = None
    over_predictions: float | None = None
    under_predictions: float | None = None
    over_tokens_mean: float | None = None
    under_tokens_mean: float | None = None
    # With --agreement: how often two dry runs of one request, one right after the other,
    # saw the same match on every worker ("view") and chose one worker (by the first's
    # kind): on two processes, and (the baseline) on one.
    process_agreement: dict[str, float | None] | None = None
    agreement_pairs: int = 0
    # Where a request spent its time (Little's law over the run): mean client-side latency, and
    # the gateway's mean count of requests in flight (decided, not yet settled), sampled from
    # /admin/workers; None for peers.
    mean_latency_ms: float = 0.0
    gateway_inflight: float | None = None
    # Our gateway's event-loop lag over the run (loadtest.gateway_lag; None for peers, or
    # when the run was shorter than one sample): the mean in ms, the share of samples over
    # 10 ms. Milliseconds of lag: the gateway itself was short of CPU.
    loop_lag_ms_mean: float | None = None
    loop_lag_over_10ms: float | None = None
    latencies_ms: list[float] = field(default_factory=list)  # per request, in trace order
    # Where the latency went, from our gateway's Server-Timing (None for peers): its own time
    # (reading, parsing and deciding; the answer's head) and the worker's (upstream), p50/p99.
    # The rest of a request's latency is the client's and the sockets' (and, at high load, the
    # wait in the gateway's socket before it is read).
    gateway_p50_ms: float | None = None
    gateway_p99_ms: float | None = None
    upstream_p50_ms: float | None = None
    upstream_p99_ms: float | None = None
    # Per request, in trace order, from the gateway's Server-Timing (empty for peers): from
    # the decision to the worker's reply.
    upstream_ms: list[float] = field(default_factory=list)
    # Per request, in trace order: the gateway's decision instant (x-route-at), seconds after
    # the run's first decision; empty where a reply did not say (peers, failures).
    decided_s: list[float] = field(default_factory=list)
    routed_to: list[str] = field(default_factory=list)  # per request: the worker that answered
    # Per request, in trace order, where it said when it was decided (ours): the worker its
    # decision pre-warmed the prefix on (x-route-prewarm; "": none), which the simulator
    # places as the gateway did.
    prewarmed_to: list[str] = field(default_factory=list)
    route_reasons: list[str] = field(default_factory=list)  # per request: x-route-reason
    # Per request, in trace order: the blocks its worker reported reusing
    # (x-cache-matched-tokens), which the simulator's workers are compared with.
    cached_blocks: list[int] = field(default_factory=list)
    # Per request, in trace order, where every reply said both (ours): seconds from the
    # gateway's decision to the worker's engine freeing the request's blocks
    # (x-engine-done-at - x-route-at), when the simulator's workers free them too.
    engine_held_s: list[float] = field(default_factory=list)
    # ... and to its engine having computed the prompt (x-engine-computed-at - x-route-at),
    # when the simulator's workers count its blocks computed too.
    engine_computed_s: list[float] = field(default_factory=list)
    # The engine scrapes (health probes' /metrics) the gateway routed on, each at its instant
    # on the decision instants: the view of a worker counts its engine's running and waiting
    # requests at the last scrape (gateway.pool.WorkerState.view).
    engine_scrapes: list[dict[str, Any]] = field(default_factory=list)
    # Requests the fleet's workers answered directly before its first router ran (Fleet.warm).
    warmed: int = 0
    # The model@version our gateway fingerprinted prompts under (/admin/workers namespaces):
    # what the simulator needs to route on the gateway's own keys.
    namespace_model: str = ""
    prewarms: int = 0  # pre-warms our gateway sent (/admin/workers prewarm)
    prewarms_used: int = 0  # ... that a later request for their prefix was routed to
    # Session copies over, and the mean milliseconds each took from the decision that asked
    # for it to its answer (the time its worker took no other copy; None: none over).
    copies_done: int = 0
    copy_ms_mean: float | None = None
    # Decisions by kind, from x-route-reason (ours only).
    reasons: dict[str, int] = field(default_factory=dict)
    worker_ids: list[str] = field(default_factory=list)  # the fleet, in order
    per_worker: dict[str, dict[str, int]] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # The gateway's rebalance actions (/admin/rebalance), "t" = seconds into the run.
    rebalance: list[dict[str, Any]] = field(default_factory=list)


# -- the fleet -----------------------------------------------------------------------------


WARM_REQUESTS_PER_WORKER = 8  # sent to each fresh worker before the first router's run


class Fleet:
    """N reference workers on consecutive ports; flushed between routers, restartable."""

    def __init__(self, config: ReplayConfig, base_port: int, logs: Path) -> None:
        self.config = config
        self.cluster = LocalCluster(
            host=HOST, gateway_port=base_port, worker_base_port=base_port + 1,
            workers=config.workers, model=MODEL, cache_blocks=config.cache_blocks,
            worker_args=config.worker_args(),
        )
        self.urls = self.cluster.worker_urls()
        self.commands = self.cluster.worker_commands()
        if config.worker_nice:
            self.commands = [["nice", "-n", str(config.worker_nice), *command]
                             for command in self.commands]
        if config.misreport_worker is not None:
            self.commands[config.misreport_worker] += [
                "--reported-cache-blocks", str(2 * config.cache_blocks)]
        # Each worker's KV-event endpoints, as a gateway's --worker URL fragment.
        self.event_fragments: list[str] = []
        if config.kv_events:
            ports = free_port_block(2 * config.workers)
            for i, command in enumerate(self.commands):
                events, replay = (f"tcp://{HOST}:{ports + 2 * i + j}" for j in (0, 1))
                command += ["--kv-events", events, "--kv-replay", replay]
                self.event_fragments.append(f"#kv-events={events}&kv-replay={replay}")
        self.logs = logs
        self.procs: list[asyncio.subprocess.Process | None] = [None] * config.workers

    async def start(self, i: int) -> None:
        started: list[asyncio.subprocess.Process] = []
        try:
            await start_server(self.commands[i], self.urls[i], self.logs / f"worker{i}.log",
                               started, START_TIMEOUT_S)
        finally:
            self.procs[i] = started[0] if started else None

    async def stop(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            await stop_processes([proc], grace_s=5.0)
        self.procs[i] = None

    async def restart(self, i: int) -> None:
        await self.stop(i)
        await self.start(i)

    async def warm(self, session: aiohttp.ClientSession, bodies: Sequence[dict[str, Any]],
                   concurrency: int) -> int:
        """Each worker's first requests, sent to it directly before any router's run (the
        flush before each run empties their blocks): a fresh worker process answers its first
        requests several times slower (code paths and memory touched for the first time), and
        only the first router of each fleet, always ours, would pay for that (its slowest
        requests came in the first 20 ms of short runs, at 90-100 ms upstream). The requests
        answered."""
        first = bodies[:WARM_REQUESTS_PER_WORKER * len(self.urls)]
        replies = await replay(session, [url + self.config.path for url in self.urls], first,
                               concurrency)
        return sum(1 for reply in replies if reply.status == 200)

    async def restart_in_place(self, session: aiohttp.ClientSession, i: int) -> None:
        """Worker ``i`` as a restart in place leaves it, without one (``POST
        /admin/restart``)."""
        async with session.post(self.urls[i] + "/admin/restart", json={}) as response:
            response.raise_for_status()

    async def flush(self, session: aiohttp.ClientSession,
                    urls: Sequence[str] | None = None) -> None:
        for url in self.urls if urls is None else urls:
            async with session.post(url + "/admin/flush", json={}) as response:
                response.raise_for_status()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Fleet]:
        try:
            outcomes = await asyncio.gather(*(self.start(i) for i in range(len(self.urls))),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            yield self
        finally:
            await asyncio.gather(*(self.stop(i) for i in range(len(self.urls))))


# -- one run -------------------------------------------------------------------------------


def first_decision(replies: Sequence[Reply]) -> float | None:
    """The run's first decision instant (``x-route-at``, the gateway's monotonic clock);
    None unless every reply said when it was decided."""
    if not replies or not all(r.decided_at for r in replies):
        return None
    return min(r.decided_at for r in replies)


def decision_instants(replies: Sequence[Reply]) -> list[float]:
    """Each reply's decision instant (``x-route-at``) after the run's first, in seconds; empty
    unless every reply said when it was decided."""
    first = first_decision(replies)
    return [] if first is None else [round(r.decided_at - first, 6) for r in replies]


def engine_holds(replies: Sequence[Reply]) -> list[float]:
    """Each reply's seconds from the gateway's decision to its engine freeing the request's
    blocks; empty unless every reply said both."""
    if not all(r.decided_at and r.engine_done_at for r in replies):
        return []
    return [round(r.engine_done_at - r.decided_at, 6) for r in replies]


def engine_computes(replies: Sequence[Reply]) -> list[float]:
    """Each reply's seconds from the gateway's decision to its engine having computed the
    prompt (its first token); empty unless every reply said both."""
    if not all(r.decided_at and r.engine_computed_at for r in replies):
        return []
    return [round(r.engine_computed_at - r.decided_at, 6) for r in replies]


def summarize(router: str, repeat: int, replies: Sequence[Reply], seconds: float,
              pooled: float, cpu_s: float | None, worker_ids: Sequence[str],
              config: ReplayConfig) -> RunResult:
    ok = [r for r in replies if r.status == 200]
    bt = config.block_tokens
    per_worker = {w: {"requests": 0, "blocks": 0, "matched_blocks": 0, "uncached_blocks": 0}
                  for w in worker_ids}
    for r in ok:
        row = per_worker.setdefault(r.worker, {"requests": 0, "blocks": 0, "matched_blocks": 0,
                                               "uncached_blocks": 0})
        blocks, matched = r.input_tokens // bt, r.matched_tokens // bt
        row["requests"] += 1
        row["blocks"] += blocks
        row["matched_blocks"] += matched
        row["uncached_blocks"] += blocks - matched
    blocks = sum(w["blocks"] for w in per_worker.values())
    matched = sum(w["matched_blocks"] for w in per_worker.values())
    hit = matched / blocks if blocks else 0.0
    ms = [r.seconds * 1e3 for r in ok] or [0.0]
    reasons = Counter(reason_kind(r.reason) for r in ok if r.reason)
    decided = decision_instants(replies)  # empty unless every reply said (ours)
    said = [r for r in ok if r.upstream_ms]  # ours: the gateway's Server-Timing
    own = [r.gateway_ms for r in said]
    held = [r.upstream_ms for r in said]
    return RunResult(
        router=router, repeat=repeat, requests=len(replies), errors=len(replies) - len(ok),
        block_hit_rate=hit, pooled_bound=pooled, hit_over_bound=hit / pooled if pooled else 0.0,
        routed_max_over_mean=max_over_mean([w["blocks"] for w in per_worker.values()]),
        requests_max_over_mean=max_over_mean([w["requests"] for w in per_worker.values()]),
        prefill_max_over_mean=max_over_mean(
            [w["uncached_blocks"] for w in per_worker.values()]),
        p50_ms=statistics.median(ms), p99_ms=percentile(ms, 99),
        cpu_s_per_1k=None if cpu_s is None else cpu_s / max(1, len(replies)) * 1000.0,
        seconds=seconds, mean_latency_ms=statistics.fmean(ms), reasons=dict(reasons),
        latencies_ms=[round(r.seconds * 1e3, 1) for r in replies],
        upstream_ms=([round(r.upstream_ms, 3) for r in replies]
                     if any(r.upstream_ms for r in replies) else []),
        decided_s=decided,
        routed_to=[r.worker for r in replies],
        prewarmed_to=[r.prewarmed_to for r in replies] if decided else [],
        cached_blocks=[r.matched_tokens // bt for r in replies],
        engine_held_s=engine_holds(replies),
        engine_computed_s=engine_computes(replies),
        route_reasons=[r.reason for r in replies] if any(r.reason for r in replies) else [],
        worker_ids=list(worker_ids), per_worker=dict(sorted(per_worker.items())),
        gateway_p50_ms=statistics.median(own) if said else None,
        gateway_p99_ms=percentile(own, 99) if said else None,
        upstream_p50_ms=statistics.median(held) if said else None,
        upstream_p99_ms=percentile(held, 99) if said else None,
    )


async def measure(router: str, repeat: int, url: str, pid: int | None, fleet: Fleet | None,
                  bodies: Sequence[dict[str, Any]], pooled: float, config: ReplayConfig,
                  worker_ids: Sequence[str], *, restart: bool = False,
                  after: Sequence[int] = (), think: Sequence[float] = ()) -> RunResult:
    """Replay ``bodies`` through ``url``; charge the CPU of process ``pid`` (if known)."""
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=max(64, 2 * config.concurrency))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await open_connections(session, url, config.concurrency)
        ours = router.startswith("ours")
        lag0 = await gateway_lag.read(session, url) if ours else None
        cpu0 = proc_tree_cpu_s(pid) if pid else None
        started, wall = time.perf_counter(), time.time()
        restarter = None
        disrupted = False  # the worker was (being) disrupted before the run ended
        disrupt = config.restart_worker or config.flush_worker or config.restart_in_place
        if restart and fleet is not None and disrupt is not None:
            index, at_s = disrupt

            async def later() -> None:
                nonlocal disrupted
                await asyncio.sleep(at_s)
                disrupted = True
                if config.restart_worker is not None:
                    print(f"[replay] {router}: restarting worker {index} at {at_s:g}s",
                          file=sys.stderr, flush=True)
                    await fleet.restart(index)
                elif config.restart_in_place is not None:
                    print(f"[replay] {router}: restarting worker {index} in place at "
                          f"{at_s:g}s", file=sys.stderr, flush=True)
                    await fleet.restart_in_place(session, index)
                else:
                    print(f"[replay] {router}: flushing worker {index} at {at_s:g}s",
                          file=sys.stderr, flush=True)
                    await fleet.flush(session, [fleet.urls[index]])
            restarter = asyncio.create_task(later())
        samples: list[int] = []
        scrapes: dict[tuple[str, float], Scrape] = {}
        agreed: list[DryRunPair] = []
        side = [asyncio.create_task(sample_inflight(session, url, samples, scrapes))] \
            if ours else []
        if config.agreement and ours:
            side.append(asyncio.create_task(sample_agreement(url, bodies, agreed)))
        with own_core([pid]) if config.own_core and pid else contextlib.nullcontext(False):
            replies = await replay(session, url + config.path, bodies, config.concurrency,
                                   after, think)
        seconds = time.perf_counter() - started
        cpu_s = proc_tree_cpu_s(pid) - cpu0 if pid and cpu0 is not None else None
        for task in side:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if restarter is not None:
            if not disrupted:  # a run shorter than the disruption's time: none, and said so
                restarter.cancel()
                print(f"[replay] {router}: the run ended after {seconds:.1f}s, before the "
                      "worker's disruption was due: none took place", file=sys.stderr,
                      flush=True)
            with contextlib.suppress(asyncio.CancelledError):
                await restarter
        lag1 = await gateway_lag.read(session, url) if ours else None
        actions = await rebalance_actions(session, url, wall) if ours else []
        view = await gateway_view(session, url) if ours else GatewayView()
    result = summarize(router, repeat, replies, seconds, pooled, cpu_s, worker_ids, config)
    result.exact_predictions = view.exact_predictions
    result.over_predictions, result.under_predictions = view.over, view.under
    result.over_tokens_mean, result.under_tokens_mean = view.over_tokens, view.under_tokens
    result.namespace_model, result.prewarms = view.namespace_model, view.prewarms
    result.prewarms_used = view.prewarms_used
    result.copies_done, result.copy_ms_mean = view.copies_done, view.copy_ms_mean
    result.gateway_inflight = statistics.fmean(samples) if samples else None
    result.loop_lag_ms_mean, result.loop_lag_over_10ms = gateway_lag.between(lag0, lag1)
    result.agreement_pairs = sum(p.across for p in agreed)
    if agreed:
        result.process_agreement = {
            f"{'across' if across else 'within'}{'' if not kind else ':' + kind}":
                agreement(agreed, across, kind)
            for across in (True, False) for kind in ("view", "", "prefix_hit", "cold")}
    result.timeline = timeline(replies, started, config.bucket_s, config.block_tokens)
    result.rebalance = actions
    if fleet is not None:  # the gateway runs on this machine: its clocks are ours
        time_actions(actions, replies, time.time() - time.monotonic())
    result.engine_scrapes = timed_scrapes(scrapes, replies)
    return result


def timed_scrapes(scrapes: Mapping[tuple[str, float], Scrape],
                  replies: Sequence[Reply]) -> list[dict[str, Any]]:
    """The engine scrapes the gateway routed on during a run, oldest first, each at its
    instant on the run's decision instants (``decided_s``; both are the gateway's monotonic
    clock), with its metrics and the requests the gateway had in flight there then (``own``;
    None when the gateway did not say): the last one before the first decision and every one
    after; empty unless every reply said when it was decided."""
    first = first_decision(replies)
    if first is None:
        return []
    latest: dict[str, float] = {}  # per worker, its last scrape before the first decision
    for wid, at in scrapes:
        if at <= first and at > latest.get(wid, 0.0):
            latest[wid] = at
    return [{"decided_s": round(at - first, 6), "worker": wid, "metrics": dict(metrics),
             "own": own}
            for (wid, at), (metrics, own) in sorted(scrapes.items(), key=lambda kv: kv[0][1])
            if at > first or latest.get(wid) == at]


def time_actions(actions: Sequence[dict[str, Any]], replies: Sequence[Reply],
                 wall_minus_monotonic: float) -> None:
    """Give each rebalance action its instant on the run's decision instants
    (``decided_s``: seconds after the first decision, on the gateway's monotonic clock), from
    its wall-clock ``at`` and the difference between the two clocks of this machine; nothing
    unless every reply said when it was decided."""
    first = first_decision(replies)
    if first is None:
        return
    for a in actions:
        at = a.get("at")
        if isinstance(at, int | float):
            a["decided_s"] = round(float(at) - wall_minus_monotonic - first, 6)


async def open_connections(session: aiohttp.ClientSession, url: str, count: int) -> None:
    """Open the client's ``count`` connections to ``url`` before the run (``GET /health`` on
    each, kept alive): otherwise the first requests of a run race their connections' setup
    and reach the router in another order than they were sent."""
    async def probe() -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/health") as response:
                await response.read()

    await asyncio.gather(*(probe() for _ in range(count)))


INFLIGHT_SAMPLE_S = 0.2
AGREEMENT_SAMPLE_S = 0.05  # a dry run on two processes (--agreement)


async def sample_inflight(session: aiohttp.ClientSession, url: str, out: list[int],
                          scrapes: dict[tuple[str, float], Scrape] | None = None,
                          ) -> None:
    """Every ``INFLIGHT_SAMPLE_S``, the gateway's count of requests in flight (all workers),
    and into ``scrapes`` each engine scrape it routes on ((worker, when on its monotonic
    clock) -> the metrics and its own requests in flight there then; a scrape stays until
    the worker's next health probe, seconds apart)."""
    while True:
        await asyncio.sleep(INFLIGHT_SAMPLE_S)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError,
                                 TypeError):
            async with session.get(url + "/admin/workers") as response:
                data = await response.json()
            out.append(sum(int(w["inflight_requests"]) for w in data["workers"]))
            if scrapes is not None:
                for w in data["workers"]:
                    at = float(w.get("scraped_at") or 0.0)
                    if at > 0:
                        own = w.get("own_at_scrape")
                        scrapes[(str(w["id"]), at)] = (
                            {k: float(v) for k, v in (w.get("engine_metrics") or {}).items()},
                            int(own) if isinstance(own, int) else None)


@dataclass(frozen=True, slots=True)
class DryRunPair:
    """Two dry runs of one request, one right after the other: on two processes of the
    gateway or on one; whether they chose one worker; the first's decision kind."""

    across: bool
    agreed: bool
    kind: str
    same_view: bool  # every worker's match (in blocks) was the same in both


def _matches(data: dict[str, Any]) -> dict[str, int]:
    return {c["worker"]: int(c["match_blocks"]) for c in data["candidates"]}


async def agreement_sample(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                           tries: int = 8) -> list[DryRunPair]:
    """Dry runs (``/admin/explain``) of ``body`` on new connections, which the kernel spreads
    over the gateway's processes, until two processes answered (at most ``tries``): each
    answer is paired with the one before it, across processes or within one. Comparing
    within one process gives the baseline: a decision that follows the load (a cold prefix's
    placement) can change between two dry runs milliseconds apart on the same process."""
    pairs: list[DryRunPair] = []
    seen: set[str] = set()
    last: tuple[str, Any] | None = None
    for _ in range(tries):
        async with session.post(url + "/admin/explain?kind=completion", json=body) as response:
            data = await response.json()
        replica, decision = data["replica"], data["decision"]
        if last is not None:
            before = last[1]["decision"]
            pairs.append(DryRunPair(across=replica != last[0],
                                    agreed=decision["worker"] == before["worker"],
                                    kind=str(before.get("kind", "")),
                                    same_view=_matches(data) == _matches(last[1])))
        last = (replica, data)
        seen.add(replica)
        if len(seen) == 2:
            break
    return pairs


def agreement(pairs: Sequence[DryRunPair], across: bool, kind: str = "") -> float | None:
    """The share of ``pairs`` (across processes, or within one) that chose one worker, of
    those whose first dry run was of decision kind ``kind`` (any with ""); ``kind`` "view":
    the share that saw the same match on every worker."""
    chosen = [p.same_view if kind == "view" else p.agreed for p in pairs
              if p.across == across and (kind in ("", "view") or p.kind == kind)]
    return sum(chosen) / len(chosen) if chosen else None


async def sample_agreement(url: str, bodies: Sequence[dict[str, Any]],
                           out: list[DryRunPair]) -> None:
    """Every ``AGREEMENT_SAMPLE_S``, one request of the replay (in a seeded order) dry-run on
    two processes of the gateway (see :func:`agreement_sample`)."""
    order = random.Random("agreement").sample(range(len(bodies)), len(bodies))
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection per dry run
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=10)) as session:
        for i in itertools.cycle(order):
            await asyncio.sleep(AGREEMENT_SAMPLE_S)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError,
                                     TypeError):
                out.extend(await agreement_sample(session, url, bodies[i]))


@dataclass(frozen=True, slots=True)
class GatewayView:
    """What our gateway's ``/admin/workers`` says after a run."""

    # The share of responses whose cached tokens it predicted exactly (None: no responses),
    # over and under, and the mean tokens off of those.
    exact_predictions: float | None = None
    over: float | None = None
    under: float | None = None
    over_tokens: float | None = None
    under_tokens: float | None = None
    namespace_model: str = ""  # the model@version it keys the replay's model under
    prewarms: int = 0  # pre-warms it sent
    prewarms_used: int = 0  # ... that a later request for their prefix was routed to
    copies_done: int = 0  # session copies over
    copy_ms_mean: float | None = None  # ... and the mean milliseconds they took


async def gateway_view(session: aiohttp.ClientSession, url: str) -> GatewayView:
    """One read of the gateway's ``/admin/workers`` (an empty view if it cannot be read)."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, TypeError,
                             AttributeError):
        async with session.get(url + "/admin/workers") as response:
            data = await response.json()
        rows = [w.get("predictions") or {} for w in data.get("workers", [])]

        def total(name: str) -> int:
            return sum(int(r.get(name, 0)) for r in rows)

        def share(name: str) -> float | None:
            return total(name) / responses if responses else None

        def mean_off(name: str) -> float | None:
            count = total(name)
            return total(f"{name}_tokens") / count if count else None

        responses = total("responses")
        model = data.get("namespaces", {}).get(MODEL, "")
        prewarm = data.get("prewarm", {})
        sent, used = prewarm.get("sent", 0), prewarm.get("used", 0)
        done, seconds = prewarm.get("copies_done", 0), prewarm.get("copy_seconds", 0.0)
        done = done if isinstance(done, int) else 0
        return GatewayView(
            exact_predictions=share("exact"), over=share("over"), under=share("under"),
            over_tokens=mean_off("over"), under_tokens=mean_off("under"),
            namespace_model=model if isinstance(model, str) else "",
            prewarms=sent if isinstance(sent, int) else 0,
            prewarms_used=used if isinstance(used, int) else 0, copies_done=done,
            copy_ms_mean=(1e3 * float(seconds) / done
                          if done and isinstance(seconds, (int, float)) else None))
    return GatewayView()


async def rebalance_actions(session: aiohttp.ClientSession, url: str,
                            wall_start: float) -> list[dict[str, Any]]:
    """The gateway's rebalance log, oldest first, timed from ``wall_start``."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.get(url + "/admin/rebalance") as response:
            data = await response.json()
        actions = [dict(a) for a in data.get("actions", []) if isinstance(a, dict)]
        for a in actions:
            a["t"] = round(float(a.get("at", wall_start)) - wall_start, 2)
        return sorted(actions, key=lambda a: float(a["t"]))
    return []


def gateway_command(fleet: Fleet, policy: str, events: bool = False,
                    view: str = "hybrid", extra: Sequence[str] = ()) -> list[str]:
    """The gateway's command line: ``policy`` over the fleet; with the fleet's tokenizer
    (token-exact keys) and, with ``events``, its workers' KV-event feeds, seen as ``view``
    (``--kv-events-view``); ``extra`` arguments last (a variant's settings)."""
    cluster, config = fleet.cluster, fleet.config
    cmd = LocalCluster(
        host=cluster.host, gateway_port=cluster.gateway_port,
        worker_base_port=cluster.worker_base_port, workers=cluster.workers, policy=policy,
    ).gateway_command()
    if config.tokenizer_file:
        cmd += ["--tokenizer-file", config.tokenizer_file,
                "--kv-block-size", str(config.block_tokens)]
    if events:
        urls = dict(zip(fleet.urls, fleet.event_fragments, strict=True))
        cmd = [a + urls[a] if a in urls else a for a in cmd]
        cmd += ["--kv-events-view", view]
    return from_checkout(cmd + gateway_log_args(config.request_logs)
                         + [a for a in extra if not a.startswith("@")], checkout_in(extra))


@contextlib.asynccontextmanager
async def gateway_running(fleet: Fleet, policy: str, events: bool = False,
                          view: str = "hybrid", extra: Sequence[str] = (),
                          label: str = "") -> AsyncIterator[tuple[str, int]]:
    """A fresh gateway with ``policy`` (and ``extra`` arguments, the variant ``label``) in
    front of the fleet: (URL, pid)."""
    cluster = fleet.cluster
    cmd = gateway_command(fleet, policy, events, view, extra)
    procs: list[asyncio.subprocess.Process] = []
    url = f"http://{cluster.host}:{cluster.gateway_port}"
    try:
        log = f"gateway-{policy}{f'-{view}' * events}{label}.log"
        await start_server(cmd, url, fleet.logs / log, procs, START_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            await wait_all_workers_up(session, url, cluster.workers, START_TIMEOUT_S)
        yield url, procs[0].pid
    finally:
        await stop_processes(procs, grace_s=5.0)


# -- the whole benchmark -------------------------------------------------------------------


def request_bodies(requests: Sequence[TraceRequest], block_chars: int, max_tokens: int,
                   seed: int = 0, invisible_edits: float = 0.0,
                   api: str = "completions", lines: bool = False) -> list[dict[str, Any]]:
    """One non-streaming completions body per trace request: its blocks as text chunks (laid
    out in lines with ``lines``); a seeded ``invisible_edits`` share of them carries one edit
    a reader cannot see (:func:`loadtest.textgen.invisible_edit`), as re-rendered contexts
    do. With ``api`` "responses", a Responses API body whose input is that text."""
    synth = TextSynth(chars=block_chars, seed=seed, lines=lines)
    spec = LiveSpec(model=MODEL, max_tokens=max_tokens, stream=False)
    rng = random.Random(f"{seed}:invisible-edits")
    bodies = []
    for r in requests:
        prompt = synth.prompt(r.blocks)
        if invisible_edits and rng.random() < invisible_edits:
            prompt = invisible_edit(prompt, rng)
        body = trace_body(spec, prompt, r.output_tokens)
        if api == "responses":
            body = {"model": body["model"], "input": prompt,
                    "max_output_tokens": body["max_tokens"], "temperature": 0}
        bodies.append(body)
    return bodies


async def run_replay(config: ReplayConfig, requests: Sequence[TraceRequest],
                     policies: Sequence[str], peers: Sequence[str], repeats: int,
                     gateway: str = "",
                     peer_args: Mapping[str, Sequence[str]] | None = None,
                     gateway_args: Mapping[str, Sequence[str]] | None = None,
                     ) -> list[RunResult]:
    """Every router on each of ``repeats`` fleets. ``peers``: router names, a peer's own
    (``smg``) or a variant of it (``smg[tight]``) run with ``peer_args[name]`` added.
    ``gateway_args``: our gateway's variants, label -> extra arguments, each run with every
    policy as ``ours[label]:policy``."""
    bodies = request_bodies(requests, config.block_chars, config.max_tokens,
                            invisible_edits=config.invisible_edits, api=config.api,
                            lines=config.text_lines)
    pooled = pooled_bound(requests, config.workers * config.cache_blocks)
    after = previous_in_session(requests) if config.session_order else []
    think = think_times(requests, after, config.think_scale) if config.think_scale > 0 else []
    results: list[RunResult] = []
    if gateway:
        for r in range(repeats):
            results.append(await measure(f"gateway@{gateway}", r, gateway, None, None, bodies,
                                         pooled, config, [], after=after, think=think))
        return results
    base = free_port_block(config.workers + 1)
    for r in range(repeats):
        for attempt in range(FLEET_ATTEMPTS):
            try:
                results += await one_fleet(config, base, r, repeats, policies, peers, bodies,
                                           pooled, peer_args or {}, gateway_args or {}, after,
                                           think)
                break
            except PeerUnavailableError:
                raise
            except (RuntimeError, OSError) as exc:
                # On a shared machine another process can take one of the fleet's ports
                # between the check and the bind: try again on another block.
                if attempt + 1 == FLEET_ATTEMPTS:
                    raise
                print(f"[replay] repeat {r + 1}: fleet failed ({str(exc)[:200]}); retrying on "
                      "other ports", file=sys.stderr, flush=True)
                base = free_port_block(config.workers + 1)
    return results


FLEET_ATTEMPTS = 3


async def one_fleet(config: ReplayConfig, base: int, r: int, repeats: int,
                    policies: Sequence[str], peers: Sequence[str],
                    bodies: Sequence[dict[str, Any]], pooled: float,
                    peer_args: Mapping[str, Sequence[str]],
                    gateway_args: Mapping[str, Sequence[str]],
                    after: Sequence[int] = (), think: Sequence[float] = ()
                    ) -> list[RunResult]:
    """One fleet on ports ``base``...: every router once, caches flushed between them."""
    results: list[RunResult] = []
    logs = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="replay-"))
    fleet = Fleet(config, base, logs)
    ids = [url.removeprefix("http://") for url in fleet.urls]
    try:
        async with fleet.running():
            async with aiohttp.ClientSession() as session:
                warmed = await fleet.warm(session, bodies, config.concurrency)
            evented = [f"ours+{view}:{p}" for view in ("events", "hybrid") for p in policies
                       ] if config.kv_events else []
            variants = [f"ours[{label}]:{p}" for label in gateway_args for p in policies]
            routers = [*(f"ours:{p}" for p in policies), *variants, *evented, *peers]
            turn = r % len(routers)  # each router goes first in turn (module docstring)
            for router in [*routers[turn:], *routers[:turn]]:
                async with aiohttp.ClientSession() as session:
                    await fleet.flush(session)
                print(f"[replay] repeat {r + 1}/{repeats}: {router} ({len(bodies)} "
                      "requests) ...", file=sys.stderr, flush=True)
                if router.startswith("ours"):
                    name, _, policy = router.partition(":")
                    label = name.removeprefix("ours[").removesuffix("]") if "[" in name else ""
                    view = name.removeprefix("ours+")
                    async with gateway_running(
                        fleet, policy, events=name.startswith("ours+"), view=view,
                        extra=gateway_args.get(label, ()), label=label,
                    ) as (url, pid):
                        res = await measure(router, r, url, pid, fleet, bodies, pooled,
                                            config, ids, restart=True, after=after,
                                            think=think)
                else:
                    async with running_peer(base_peer(router), fleet.urls, logs,
                                            extra=peer_args.get(router, ()), log_name=router,
                                            request_logs=config.request_logs) as peer:
                        res = await measure(router, r, peer.url, peer.pid, fleet, bodies,
                                            pooled, config, ids, after=after, think=think)
                agree = ("" if res.process_agreement is None else
                         ", dry runs agree " + ", ".join(
                             f"{k} {v:.2f}" for k, v in res.process_agreement.items()
                             if v is not None) + f" ({res.agreement_pairs} pairs across)")
                lag = ("" if res.loop_lag_ms_mean is None else
                       f", loop lag {res.loop_lag_ms_mean:.1f} ms")
                print(f"[replay] {router}: hit {res.block_hit_rate:.3f} "
                      f"({res.hit_over_bound:.3f} of bound), routed max/mean "
                      f"{res.routed_max_over_mean:.2f}, p50 {res.p50_ms:.0f} ms, "
                      f"{res.seconds:.0f}s, errors {res.errors}{lag}{agree}", file=sys.stderr,
                      flush=True)
                res.warmed = warmed
                results.append(res)
    finally:
        await asyncio.to_thread(shutil.rmtree, logs, True)
    return results


MEDIAN_KEYS = ("block_hit_rate", "hit_over_bound", "routed_max_over_mean",
               "requests_max_over_mean", "prefill_max_over_mean", "p50_ms", "p99_ms",
               "cpu_s_per_1k", "exact_predictions", "over_predictions", "under_predictions",
               "over_tokens_mean", "under_tokens_mean", "gateway_p50_ms", "gateway_p99_ms",
               "upstream_p50_ms", "upstream_p99_ms", "loop_lag_ms_mean", "loop_lag_over_10ms")


def medians(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per router (first-seen order), the median of each metric over its repeats."""
    by_router: dict[str, list[RunResult]] = {}
    for res in results:
        by_router.setdefault(res.router, []).append(res)
    out = []
    for router, runs in by_router.items():
        row: dict[str, Any] = {"router": router, "repeats": len(runs),
                               "pooled_bound": runs[0].pooled_bound,
                               "errors": sum(r.errors for r in runs)}
        for key in MEDIAN_KEYS:
            values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


def _ttft(sim: Mapping[str, Any], key: str) -> str:
    value = sim.get(key)
    return "-" if value is None else f"{value:.1f}"


def markdown(rows: Sequence[dict[str, Any]], sims: Sequence[dict[str, Any]]) -> str:
    lines = ["| router | runs | hit | hit / pooled bound | routed blocks max/mean | "
             "prefill max/mean | p50 ms | p99 ms | CPU s / 1k req | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = "-" if r["cpu_s_per_1k"] is None else f"{r['cpu_s_per_1k']:.2f}"
        lines.append(f"| {r['router']} | {r['repeats']} | {r['block_hit_rate']:.3f} | "
                     f"{r['hit_over_bound']:.3f} | {r['routed_max_over_mean']:.2f} | "
                     f"{r['prefill_max_over_mean']:.2f} | {r['p50_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {cpu} | {r['errors']} |")
    for s in sims:
        same = s.get("same_worker")
        note = "" if same is None else f", {same:.0%} of requests on the live worker"
        lines.append(f"| {s['router']} (simulated{note}) | {s['repeats']} | "
                     f"{s['block_hit_rate']:.3f} | {s['hit_over_bound']:.3f} | "
                     f"{s['routed_max_over_mean']:.2f} | {s['prefill_max_over_mean']:.2f} | "
                     f"{_ttft(s, 'ttft_p50_ms')} | {_ttft(s, 'ttft_p99_ms')} | - | 0 |")
        d = s.get("decisions")
        if d is not None:
            same = d.get("same_worker")
            note = "" if same is None else f", {same:.0%} on the live worker"
            cached = d.get("same_cached")
            note += "" if cached is None else f", {cached:.0%} reusing what it did live"
            lines.append(f"| {s['router']} (simulated at the gateway's decision "
                         f"instants{note}) | {s['repeats']} | "
                         f"{d['block_hit_rate']:.3f} | {d['hit_over_bound']:.3f} | "
                         f"{d['routed_max_over_mean']:.2f} | {d['prefill_max_over_mean']:.2f} | "
                         f"{_ttft(d, 'ttft_p50_ms')} | {_ttft(d, 'ttft_p99_ms')} | - | 0 |")
    notes = (["simulated rows: p50 and p99 are the simulated engines' time to first token, "
              "without the gateway's, the client's and the sockets' time"] if sims else [])
    notes += [f"{s['router']}, simulated minus live, the largest over {s['repeats']} runs: "
             + "; ".join(f"{'client model' if name == 'client' else 'at the decision instants'}"
                         f" hit/bound {a['hit']:+.3f}, balance {a['balance']:+.3f}"
                         for name, a in s["agreement"].items())
             for s in sims if s.get("agreement")]
    notes += [f"{r['router']}, where the latency went by its Server-Timing: the gateway's own "
              f"time p50 {r['gateway_p50_ms']:.2f} / p99 {r['gateway_p99_ms']:.2f} ms, the "
              f"worker's p50 {r['upstream_p50_ms']:.1f} / p99 {r['upstream_p99_ms']:.1f} ms; "
              "the rest is the client's and the sockets'"
              for r in rows if r.get("gateway_p50_ms") is not None
              and r.get("upstream_p50_ms") is not None]
    notes += [f"{r['router']}, its event loop's lag over the run: mean "
              f"{r['loop_lag_ms_mean']:.1f} ms, {r['loop_lag_over_10ms']:.0%} of the samples "
              "over 10 ms (milliseconds: the gateway was short of CPU)"
              for r in rows if r.get("loop_lag_ms_mean") is not None
              and r.get("loop_lag_over_10ms") is not None]
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


# -- command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest replay",
                                description="Live closed-loop trace replay through the gateway "
                                "and peer routers in front of the same reference workers.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help=f"Mooncake jsonl trace (default {DEFAULT_TRACE})")
    src.add_argument("--workload", choices=TRACE_WORKLOADS,
                     help="a generated workload (loadtest.trace_workloads) instead of a file")
    p.add_argument("--requests", type=int, default=0,
                   help="--workload: requests to generate (0: the shape's default)")
    p.add_argument("--limit", type=int, help="only the first K requests of the trace")
    p.add_argument("--skip", type=int, default=0,
                   help="drop the first S requests (before --limit): replay a window from the "
                   "middle of a long trace, e.g. agent sessions at long contexts")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-blocks", type=int, default=500, help="trace blocks per worker cache")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--policy", default=GatewaySettings().policy,
                   help="gateway policy, a comma list, or 'all' (default: the gateway default)")
    p.add_argument("--gateway", default="", help="replay through this running gateway instead")
    p.add_argument("--peers", action="store_true", help="also sglang-router and smg")
    p.add_argument("--peer", action="append", default=[], choices=sorted(PEERS),
                   help="also this peer (repeatable): --peers without the others")
    p.add_argument("--peer-variant", action="append", default=[], metavar="PEER[LABEL]=ARGS",
                   help="also run a peer with these arguments, reported as PEER[LABEL] "
                   "(repeatable), e.g. 'smg[tight]=--balance-abs-threshold 4 "
                   "--balance-rel-threshold 1.2'")
    p.add_argument("--gateway-variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also run our gateway with these arguments, reported as "
                   "ours[LABEL]:POLICY (repeatable), e.g. 'vg0=--volume-guard 0'; an "
                   "argument @DIR runs it from the checkout in DIR")
    p.add_argument("--report-cache-size", action=argparse.BooleanOptionalAction, default=True,
                   help="workers publish vllm:cache_config_info (default yes)")
    p.add_argument("--repeat", type=int, default=1, help="fleets, each router once per fleet")
    p.add_argument("--block-chars", type=int, default=64,
                   help="characters of text per trace block (multiple of 64; default 64)")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per request cap")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0,
                   help="worker cost per uncached token (a token is 4 characters)")
    p.add_argument("--cached-us-per-token", type=float, default=0.0)
    p.add_argument("--decode-ms-per-token", type=float, default=0.0)
    p.add_argument("--max-running", type=int, default=32, help="worker admission limit")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="extra worker flag, repeatable: --worker-arg=--engine=torch runs the "
                   "real engine (its time replaces the simulated costs)")
    p.add_argument("--simulate", action="store_true",
                   help="also run the simulator on the same fleet for each gateway policy")
    p.add_argument("--sim-draws", type=int, default=1,
                   help="simulator runs per live run: the first on the run's own timing, the "
                   "others with it jittered; their mean is reported (default 1)")
    p.add_argument("--resimulate", type=Path, metavar="REPORT",
                   help="only re-run the simulator against the live runs of a saved --json "
                   "report of this command")
    p.add_argument("--sim-set", action="append", default=[], metavar="NAME=VALUE",
                   help="with --simulate or --resimulate: simulate with this change (a "
                   "simulator option such as prewarm=false, or policy.NAME=VALUE for a "
                   "routing option such as policy.volume_guard=1.1); at the gateway's "
                   "decision instants, what it would have done otherwise (repeatable)")
    # One disruption of worker I, T seconds into every gateway run.
    for flag, disruption in (
        ("--restart-worker", "restart worker I"),
        ("--flush-worker", "empty worker I's cache (the process stays up, so only the hit "
         "telemetry can tell the gateway)"),
        ("--restart-in-place", "make worker I look restarted without taking it down: its "
         "cache empty, its counters at zero and a new start stamp on its replies (what a "
         "restart between two probes shows)"),
    ):
        p.add_argument(flag, metavar="I@T",
                       help=f"{disruption}, T seconds into every gateway run")
    p.add_argument("--session-order", action=argparse.BooleanOptionalAction, default=True,
                   help="send each request only once its session's previous one was answered "
                   "(an agent's or a chat user's next turn; the default); --no-session-order: "
                   "the trace's order alone, so that turns of one session may overlap")
    p.add_argument("--think-scale", type=float, default=0.0, metavar="X",
                   help="with --session-order, each request also waits X times the trace's "
                   "time between it and its session's previous request after that one's "
                   "answer (an agent's think time or tool call; default 0: it leaves at the "
                   "answer)")
    p.add_argument("--misreport-worker", type=int, metavar="I",
                   help="worker I reports twice its real cache size")
    p.add_argument("--timeline", type=Path, metavar="DIR",
                   help="write timeline.json and timeline.png (per-worker hit rate and "
                   "mispredictions over time) per run into DIR")
    p.add_argument("--bucket", type=float, default=2.0, help="timeline: seconds per point")
    p.add_argument("--tokenizer-file", default="",
                   help="workers and gateways tokenize with this tokenizer.json (python -m "
                   "loadtest.tiny_tokenizer OUT makes one): token-exact keys; hit rates count "
                   "engine blocks of block-chars/4 tokens")
    p.add_argument("--kv-events", action="store_true",
                   help="workers publish KV events; every policy also runs as "
                   "ours+events:<policy> (the events alone) and ours+hybrid:<policy> (the "
                   "modelled index corrected by them) (needs --tokenizer-file)")
    p.add_argument("--api", choices=sorted(API_PATHS), default="completions",
                   help="send each trace request as a completions request (its text as the "
                   "prompt) or a Responses API request (its text as the input); the simulator "
                   "models completions only")
    p.add_argument("--invisible-edits", type=float, default=0.0, metavar="SHARE",
                   help="share of requests with one invisible edit in their prompt (a "
                   "zero-width or no-break space, a soft hyphen, trailing spaces; with "
                   "--text-lines also trailing spaces on an inner line)")
    p.add_argument("--text-lines", action="store_true",
                   help=f"lay the synthesized text out in lines of {LINE_WORDS} words, as code "
                   "and documents come (the same words and blocks)")
    p.add_argument("--request-logs", action="store_true",
                   help="every router logs each request as it does by default (ours one JSON "
                   "access line, the peers at --log-level info); without it none does (ours "
                   "--access-log off, the peers at --log-level warn), so their CPU and "
                   "latency compare like with like")
    p.add_argument("--agreement", action="store_true",
                   help="with a gateway of several processes (GATEWAY_PROCS=N): every "
                   f"{AGREEMENT_SAMPLE_S:g} s, dry-run one of the requests on two of them "
                   "(/admin/explain) and report how often they chose the same worker")
    p.add_argument("--own-core", action="store_true",
                   help="each router (every thread of its process tree) on one CPU while it "
                   "is measured, the client and the workers on the others, as a router runs "
                   "where it is deployed; by default all of them share every CPU")
    p.add_argument("--worker-nice", type=int, default=0, metavar="N",
                   help="start the workers at niceness N (0-19; 0, the default: as the "
                   "client's): on shared CPUs a router that is runnable then goes before the "
                   "workers it has just woken, as where the engines run on hosts of their "
                   "own; every router alike")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def gateway_variant(spec: str) -> tuple[str, list[str]]:
    """Our gateway run with arguments of its own, ``LABEL=ARGS`` (``vg0=--volume-guard 0``):
    the label (reported as ``ours[LABEL]:POLICY``) and the extra arguments. Raises
    ``ValueError`` for a spec of another form."""
    label, sep, args = spec.partition("=")
    if not sep or re.fullmatch(r"[\w.-]+", label.strip()) is None:
        raise ValueError(f"a gateway variant is LABEL=ARGS, not {spec!r}")
    return label.strip(), shlex.split(args)


def parse_policies(text: str) -> list[str]:
    if text == "all":
        return list(POLICY_NAMES)
    names = [p for p in text.split(",") if p]
    unknown = sorted(set(names) - set(POLICY_NAMES))
    if unknown or not names:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    return names


def config_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> ReplayConfig:
    if min(args.workers, args.cache_blocks, args.concurrency, args.repeat,
           args.max_tokens, args.max_running) < 1:
        p.error("--workers, --cache-blocks, --concurrency, --repeat, --max-tokens and "
                "--max-running must be >= 1")
    if not 0 <= args.worker_nice <= 19:
        p.error("--worker-nice must be within 0-19")
    if not 0.0 <= args.invisible_edits <= 1.0:
        p.error("--invisible-edits is a share, from 0 to 1")
    if args.block_chars < 64 or args.block_chars % 64:
        p.error("--block-chars must be a multiple of 64 (the gateway's block)")
    if args.kv_events and not args.tokenizer_file:
        p.error("--kv-events needs --tokenizer-file (events are keyed by token ids)")
    if args.api != "completions" and (args.simulate or args.agreement):
        p.error("--api responses runs live only (no --simulate or --agreement)")
    def at(flag: str, text: str | None) -> tuple[int, float] | None:
        if not text:
            return None
        index, _, seconds = text.partition("@")
        try:
            return int(index), float(seconds)
        except ValueError:
            p.error(f"{flag} takes I@T, e.g. 0@20")

    restart = at("--restart-worker", args.restart_worker)
    flush = at("--flush-worker", args.flush_worker)
    in_place = at("--restart-in-place", args.restart_in_place)
    if sum(1 for d in (restart, flush, in_place) if d) > 1:
        p.error("one of --restart-worker, --restart-in-place and --flush-worker")
    for index in (*(d[0] for d in (restart, flush, in_place) if d), args.misreport_worker):
        if index is not None and not 0 <= index < args.workers:
            p.error(f"worker index {index} is not in 0..{args.workers - 1}")
    if args.think_scale < 0 or (args.think_scale > 0 and not args.session_order):
        p.error("--think-scale needs a value >= 0, and --session-order")
    return ReplayConfig(
        workers=args.workers, cache_blocks=args.cache_blocks, concurrency=args.concurrency,
        block_chars=args.block_chars, max_tokens=args.max_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
        cached_us_per_token=args.cached_us_per_token,
        decode_ms_per_token=args.decode_ms_per_token, max_running=args.max_running,
        report_cache_size=args.report_cache_size, misreport_worker=args.misreport_worker,
        restart_worker=restart, flush_worker=flush, restart_in_place=in_place,
        session_order=args.session_order, think_scale=args.think_scale, bucket_s=args.bucket,
        tokenizer_file=args.tokenizer_file, kv_events=args.kv_events,
        invisible_edits=args.invisible_edits, text_lines=args.text_lines,
        agreement=args.agreement,
        request_logs=args.request_logs, api=args.api, own_core=args.own_core,
        worker_nice=args.worker_nice, extra_worker_args=tuple(args.worker_arg),
    )


def load_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The trace the arguments name (file or workload, ``--skip``, ``--limit``) and a label."""
    if args.workload:
        requests = workload_trace(args.workload, args.requests, args.seed)
        source = f"{args.workload} (seed {args.seed})"
    else:
        requests = read_mooncake(args.trace or DEFAULT_TRACE)
        source = str(args.trace or DEFAULT_TRACE)
    if args.skip > 0:
        requests = requests[args.skip:]
        source += f", from request {args.skip}"
    if args.limit:
        requests = requests[: args.limit]
    return requests, source


def report_args(report: dict[str, Any]) -> argparse.Namespace:
    """The replay options a saved ``--json`` report was made with (its command line)."""
    # The arguments after "python -m loadtest replay".
    return build_parser().parse_args(shlex.split(report["command"])[4:])


@dataclasses.dataclass(frozen=True)
class SavedReport:
    """A saved ``--json`` report read back: its options, fleet, trace and live runs."""

    report: dict[str, Any]
    args: argparse.Namespace
    config: ReplayConfig
    requests: list[TraceRequest]
    source: str  # the trace's label
    results: list[RunResult]


def load_report(path: Path) -> SavedReport:
    """The saved report at ``path``, with the trace and fleet its command line names and each
    live run (its timing, worker ids and latencies) as a :class:`RunResult`."""
    report = json.loads(path.read_text(encoding="utf-8"))
    args = report_args(report)
    config = config_from_args(build_parser(), args)
    requests, source = load_requests(args)
    known = {f.name for f in dataclasses.fields(RunResult)}
    results = [RunResult(**{k: v for k, v in run.items() if k in known})
               for run in report["runs"]]
    return SavedReport(report, args, config, requests, source, results)


def request_tails(results: Sequence[RunResult], requests: Sequence[TraceRequest],
                  config: ReplayConfig) -> list[RouterTails]:
    """Each router's latency by the kind of request (:mod:`loadtest.tails`), the requests'
    prompts in the trace's blocks, as the workers' reused blocks are counted."""
    return tails(results, [r.key.total_blocks for r in requests], config.concurrency)


def resimulate(path: Path, draws: int, as_json: bool, overrides: Overrides | None = None) -> int:
    """Re-run the simulator against the live runs of a saved ``--json`` report (same trace and
    fleet, from its command line; each run's timing, worker ids and latencies) and print the
    report with its ``simulated`` section replaced."""
    saved = load_report(path)
    report, requests, source = saved.report, saved.requests, saved.source
    report["simulated"] = simulate_runs(requests, saved.config, saved.results, draws, overrides)
    by_kind = request_tails(saved.results, requests, saved.config)
    report["tails"] = [asdict(t) for t in by_kind]
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        changed = f", simulated with {overrides}" if overrides else ""
        print(f"```\n{report['command']}\n```\n\n{source}: {len(requests)} requests "
              f"(simulator re-run with {draws} draws per live run{changed})\n")
        print(markdown(report["medians"], report["simulated"]), end="")
        print(paired_markdown(paired(saved.results)), end="")
        print(tails_markdown(by_kind), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.sim_draws < 1:
        parser.error("--sim-draws must be >= 1")
    try:
        overrides = sim_overrides(args.sim_set)
    except ValueError as exc:
        parser.error(str(exc))
    if overrides and not (args.simulate or args.resimulate):
        parser.error("--sim-set needs --simulate or --resimulate")
    if args.resimulate is not None:
        return resimulate(args.resimulate, args.sim_draws, args.json, overrides)
    config = config_from_args(parser, args)
    try:
        policies = parse_policies(args.policy)
    except ValueError as exc:
        parser.error(str(exc))
    if args.gateway and (args.peers or args.peer or args.peer_variant or args.simulate
                         or args.gateway_variant or len(policies) > 1):
        parser.error("--gateway replays through that gateway only (no --peers, --simulate)")
    requests, source = load_requests(args)
    peers = list(PEERS) if args.peers else []
    peers += [name for name in args.peer if name not in peers]
    try:
        variants = dict(peer_variant(spec) for spec in args.peer_variant)
    except ValueError as exc:
        parser.error(str(exc))
    peers += [name for name in variants if name not in peers]
    try:
        ours = dict(gateway_variant(spec) for spec in args.gateway_variant)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        results = asyncio.run(run_replay(config, requests, policies, peers, args.repeat,
                                         args.gateway.rstrip("/"), variants, ours))
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError,
            PeerUnavailableError) as exc:
        print(f"python -m loadtest replay: {exc}", file=sys.stderr)
        return 1
    if args.timeline is not None:
        for res in results:
            events = [(float(a["t"]), f"{a['action']} {a.get('blocks', '')}")
                      for a in res.rebalance]
            write_timeline(res.timeline, args.timeline / f"{res.router.replace(':', '-')}"
                           f"-{res.repeat}", res.router, events)
    rows = medians(results)
    sims = (simulate_runs(requests, config, results, args.sim_draws, overrides)
            if args.simulate else [])
    command = shlex.join(["python", "-m", "loadtest", "replay", *args_list])
    sticky = sticky_balance(requests, config.workers)
    if args.json:
        print(json.dumps({"command": command, "trace": source, "requests": len(requests),
                          "python": interpreter(), "config": asdict(config),
                          "sticky_balance": asdict(sticky), "medians": rows,
                          "paired": [asdict(p) for p in paired(results)],
                          "tails": [asdict(t) for t in request_tails(results, requests, config)],
                          "simulated": sims, "runs": [asdict(r) for r in results]}, indent=2))
    else:
        print(f"```\n{command}\n```\n\n{source}: {len(requests)} requests, {config.workers} "
              f"workers x {config.cache_blocks} blocks, concurrency {config.concurrency}, "
              f"{interpreter()}; {sticky.sessions} sessions, routed max/mean with each on one "
              f"worker at least {sticky.largest_over_mean:.2f} "
              f"({sticky.packed_over_mean:.2f} packed in advance)\n")
        print(markdown(rows, sims), end="")
        print(paired_markdown(paired(results)), end="")
        print(tails_markdown(request_tails(results, requests, config)), end="")
    return 0 if all(r.errors == 0 for r in results) else 1
