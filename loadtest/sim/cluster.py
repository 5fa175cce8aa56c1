"""Discrete-event simulation of a gateway in front of N workers, each with a real KV cache.

What is real (imported, not copied): the routing engine and its policies, the ring, the prefix
index (``gateway.routing``), the worker's paged prefix cache (:class:`worker.kvcache.PrefixCache`)
and the worker's cost model (:class:`worker.engines.sim.SimCosts`). What is simulated: time,
the network (instant) and the client.

**Units.** One trace block (a Mooncake ``hash_id``, 512 tokens; one of the live replay's units,
``block_tokens``) is one cache block: each worker has ``PrefixCache(num_blocks=cache_blocks,
block_size=1)`` whose "tokens" are the request's block hashes, so ``matched_tokens`` there
counts matched blocks.

**Client.** Requests become ready at their arrival time and are issued in trace order while
fewer than ``concurrency`` are in flight (unbounded when ``None``). Two modes:

* ``sequential`` (default, ``concurrency`` 64): every request is ready at t=0, so the trace
  is replayed in order with a fixed number in flight; the next one is issued when one finishes.
  This is how peers replay the trace ("sequential order, concurrency 64"), so hit rates are
  comparable with theirs; time is virtual and only orders events.
* ``replay``: arrivals at ``timestamp / speedup`` (open loop unless ``concurrency`` is set), so
  queueing and TTFT reflect the trace's real burstiness under the cost model.

**Gateway.** The gateway's own :class:`~gateway.session.RoutingSession` over a real
:class:`~gateway.pool.WorkerPool` and :class:`~gateway.routing.prefix_index.PrefixIndex`: for
each issued request ``session.route(request, now)`` with the simulated time (snapshot, decision,
index record, in-flight accounting: ``input + output`` tokens, added at dispatch), timed with
``perf_counter``; ``session.completed`` with the blocks the worker reused when it finishes.
With ``streaming`` the gateway also sees each first token (``session.first_token``: the
request's prefill no longer counts as queued), as it does on a streamed reply. Its cache reports
feed the gateway's own :class:`~gateway.rebalance.Rebalancer`, which decides
and applies its actions every ``rebalance_interval_s`` of simulated time, as the live gateway's
background loop does (0: never). After each decision the gateway's own
:class:`~gateway.prewarm.PreWarmer` chooses whether to pre-warm the prompt on another worker
(``PreWarmer.target``); a pre-warm is recorded in the index at that decision, as the live
gateway records it, and replayed on that worker prefill-only, taking its cache blocks as the
live one does (``prewarm``).

**Where a live request spends its time.** A live gateway is a process with a clock: a request
waits ``route_delay_s`` from the client's send to the routing decision (reading, parsing and
queueing in the gateway's event loop), and the gateway settles it ``relay_delay_s`` after the
worker finished (relaying the reply, queueing again). The decision's time (``now``) therefore
advances even when the workers cost nothing, which moves everything the index decays over time
(prefix heat, recent requests, cache turnover); and the gateway counts a request in flight from
its decision to its settlement, while the worker holds the prompt's blocks only while it runs
it. Both delays are 0 by default (time is the workers' cost model alone). The live replay
(:mod:`loadtest.replay`) gives each request its own measured timing instead
(``request_delays``): the wait before its decision and the gateway's hold from the decision to
the worker's reply, so that every request is decided when it was live and counts in flight on
its worker for as long as it did there. Its worker frees the prompt's blocks when the live
engine did (``engine_holds``, as the reference worker says: ``x-engine-done-at``), or after
its cost model's time if that is later; without them, after its cost model's time. An
engine puts a request's blocks back at the young end of its LRU when it frees them, so the
order requests end in is the order a full cache keeps their prefixes in. Neither the gateway's
hold (the reply's way back reorders requests that end together) nor the cost model (a live
engine on a loaded machine runs longer than it says; with prefills sharing compute the
simulated caches kept 1-2 points more of Mooncake's blocks than the live ones) gives that
order.
One event loop decides one request at a time, in the
order they reach it: decisions keep the order requests were sent in, at least
``decision_gap_s`` apart (the gateway's CPU time per request, in the replay). That spacing
matters beyond timing: among holders in the same state, the index's decayed request counts
break the tie toward the one used least recently, and decisions made at one instant would all
fall to ring order instead.

**Worker** (cost model, shape of ``SimEngine``): at most ``max_running`` admitted requests; the
rest wait in a FIFO queue (head-of-line: a request whose blocks do not fit waits, and so do the
ones behind it). Admission allocates the prompt's blocks in the cache (reusing the longest cached
prefix; blocks of running requests cannot be evicted) and release happens at completion.
Prefill costs ``SimCosts.prefill_seconds(uncached_tokens, cached_tokens)`` with
``cached_tokens = min(matched_blocks * block_tokens, input_tokens)``
(``SimConfig.block_tokens``: a trace block's 512 tokens, or the live replay's block size for
its units); prefills run one at a time per worker in admission order (prefill is compute
bound: a worker's uncached tokens queue up), unless ``serial_prefill`` is off (each takes its
own time, whatever else runs: the reference worker's default). With
``SimCosts.prefill_shared`` they share the engine's compute as the reference worker's
``--prefill-shared`` does, with its own bookkeeping
(:class:`worker.engines.compute.ProcessorSharing`): while ``n`` are in prefill each progresses at
``1/n`` of its speed. The first token comes at the end of prefill (TTFT = dispatch to end of
prefill: queue + prefill wait + prefill), then decode takes ``SimCosts.decode_seconds(output)``
and runs alongside other requests' decode without slowing them.

**Health probes.** Once every ``probe_interval_s`` of simulated time (the gateway's
``health_interval_s``), the workers in turn and evenly apart as the gateway spreads a round,
the gateway reads each worker's engine metrics, as its health probes scrape vLLM's
``/metrics``: the running and waiting requests, and the sums and counts of the admission-wait
and time-to-first-token histograms (from each request's arrival at the worker; counted when it
is admitted, its first token's time known then). A live replay gives the live
run's scrapes instead (``scrape_log``); from the client's timing, it gives the scrapes of the
live gateway's start-up round (``start_scrapes``), so the fleet begins as the live one did:
engines the replay harness warmed, whose first tokens the gateway has seen, exempt from the
load bound while quick (``quick_first_token_s``), not engines it knows nothing about.

Default costs (:data:`DEFAULT_COSTS`): 100 us per uncached prompt token (10k tokens/s of prefill
per worker), 2.5 us per cached token (the 1:40 ratio of ``SimCosts``' defaults), 5 ms per output
token (``SimCosts``' default). On the conversation trace (3.4 requests/s, ~12k prompt tokens
each) that keeps 8 workers at roughly a third to a half of their prefill capacity at 1x, so queueing
shows where a policy concentrates load instead of everywhere.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import xxhash

from gateway.contracts.engine_metrics import (
    FIRST_TOKEN_TIME_COUNT,
    FIRST_TOKEN_TIME_SUM,
    QUEUE_TIME_COUNT,
    QUEUE_TIME_SUM,
    RUNNING,
    WAITING,
)
from gateway.fingerprint import FingerprintOptions, PrefixKey, checkpoint_depths
from gateway.pool import WorkerPool
from gateway.prewarm import PreWarmer, PrewarmOptions, held_prefix
from gateway.rebalance import RebalanceAction, RebalanceOptions, Rebalancer
from gateway.routing.policies import PolicyOptions
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Decision, DecisionKind, RouteRequest, Worker
from gateway.session import Attempt, CacheUsage, Router, RoutingSession
from gateway.settings import GatewaySettings
from gateway.store.base import CacheReport, HitCounters
from gateway.store.memory import MemoryStore
from gateway.warmup_sources import WarmPrompt
from loadtest.sim.routers import build_router
from loadtest.traces import BLOCK_TOKENS, TraceRequest
from worker.engines.compute import ProcessorSharing
from worker.engines.sim import SimCosts
from worker.kvcache import CacheFullError, PrefixCache, Reuse

Mode = Literal["sequential", "replay"]

DEFAULT_COSTS = SimCosts(
    prefill_us_per_token=100.0, prefill_us_per_cached_token=2.5, decode_ms_per_token=5.0
)
MODEL = "trace-model"


def _gateway_default(name: str) -> float:
    """A default of the gateway's settings, so the simulator follows them when they change."""
    value = getattr(GatewaySettings(), name)
    assert isinstance(value, int | float)
    return float(value)


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int
    cache_blocks: int
    policy: str
    mode: Mode = "sequential"
    concurrency: int | None = 64
    speedup: float = 1.0
    max_running: int = 32
    costs: SimCosts = DEFAULT_COSTS
    # Prefills one at a time per worker; off, each its own time (costs.prefill_shared:
    # sharing the engine's compute instead, whatever this says).
    serial_prefill: bool = True
    # The gateway's policy options (load factor, weights...), its defaults unless replaced.
    policy_options: PolicyOptions = field(default_factory=PolicyOptions)
    index_capacity: int = field(default_factory=lambda: int(_gateway_default("index_capacity")))
    index_ttl_s: float = field(default_factory=lambda: _gateway_default("index_ttl_s"))
    # The index models each worker's cache as an LRU of its real size (PrefixIndex.set_capacity).
    index_knows_capacity: bool = True
    # Worker names (hence ring positions): see worker_ids; or these names (a live fleet's ids,
    # so that the simulated ring is the live gateway's).
    ring_seed: int = 0
    worker_names: tuple[str, ...] = ()
    # Live timing (module docstring): client send -> decision, worker done -> settled.
    route_delay_s: float = 0.0
    relay_delay_s: float = 0.0
    # Per request, by position in the trace: (seconds from the client's send to the decision,
    # seconds from the decision to settlement, the worker's own time included), as a live run
    # measured them. Given, they replace both delays above; a request's worker runs it for its
    # cost model's time (or until its live engine was done: engine_holds), and the gateway
    # settles it when its hold ends (or when the worker is done, if that is later; in mode
    # "replay", the live decision instants, when its hold ends once the engine took it in).
    request_delays: tuple[tuple[float, float], ...] = ()
    # Per request, by position in the trace: seconds from the decision to the live engine
    # freeing the request's blocks; given, the simulated worker frees them then (or at its
    # cost model's end, if later).
    engine_holds: tuple[float, ...] = ()
    # Per request, by position in the trace: seconds from the decision to the live engine
    # having computed the prompt (its first token); given, with ``reuse`` "scheduled" or
    # "computed" the simulated worker counts its blocks computed then (or at its cost
    # model's first token, if later). A request reaches the live engine a few milliseconds
    # after its decision, which the cost model does not count: with reuse once computed, a
    # request that shares a prompt being prefilled found it computed in the simulator and
    # not live (and under "scheduled", a request reusing it answered sooner).
    engine_computed: tuple[float, ...] = ()
    # Seconds from its decision that a session copy (the volume guard's, ``copy_to``) keeps
    # its worker from taking another copy at least (``PreWarmer.copied``): a live run's mean
    # (its gateway's ``copy_seconds`` over ``copies_done``). A live copy is a whole history's
    # prefill on an engine that shares its compute with the requests there: 5-6 times a
    # request's mean hold on agent sessions, about what the cost model's job takes (372 ms
    # live, 359 simulated at the median). 0: until its simulated job ends.
    copy_hold_s: float = 0.0
    # Tokens in one block of the requests' ``blocks``: what a matched block saves of a
    # prefill. The traces' blocks hold 512 tokens; the live replay's units (``live_units``,
    # ``token_units``) hold its workers' block size.
    block_tokens: int = BLOCK_TOKENS
    # The gateway's time per decision: one event loop decides one request at a time, in the
    # order they reach it, so two decisions are at least this far apart.
    decision_gap_s: float = 0.0
    # Per request, by position in the trace: the key the live gateway computed from the
    # request's text (its ring anchor and checkpoints); given, routing uses it instead of the
    # trace's key (key_blocks_per_block), and the cache still holds the trace's blocks.
    route_keys: tuple[PrefixKey, ...] = ()
    # Fingerprint blocks per trace block: 0 routes on the trace's keys as they are (one hash per
    # trace block); n >= 1 on the key the gateway computes when each trace block is n of its
    # fingerprint blocks of text (gateway_key: checkpoints beyond the dense head), as in the
    # live replay, where one trace block is one 64-character block.
    key_blocks_per_block: int = 0
    # Streamed replies: the gateway sees each request's first token (session.first_token)
    # when its prefill ends, and stops counting that prefill as queued; otherwise at the end.
    streaming: bool = False
    # The gateway's predictive pre-warming (gateway.prewarm), its default unless replaced.
    prewarm: bool = field(default_factory=lambda: bool(GatewaySettings().prewarm))
    # A pre-warm copies the prefix its holder has (gateway.prewarm.held_prefix), as the gateway
    # does; False: the whole request, as with --prewarm-whole.
    prewarm_cut: bool = True
    # The engine ``priority`` session copies (the volume guard's) are sent with, the
    # gateway's ``copy_priority``: above 0 (lower runs first, as vLLM's), on engines that run
    # priority scheduling (``priority_engines``), a copy prefills only while no client request
    # is in prefill on its worker (with ``costs.prefill_shared``). 0: as a client's request.
    copy_priority: int = field(default_factory=lambda: GatewaySettings().copy_priority)
    # The engines run priority scheduling (vLLM's --scheduling-policy priority; the live
    # workers' own flag): the gateway's probe finds they take the copies' priority. False:
    # first-come-first-served engines, which refuse it, and the copies go without.
    priority_engines: bool = False
    # The gateway's rebalancer, every this many simulated seconds (0: off).
    rebalance_interval_s: float = field(
        default_factory=lambda: _gateway_default("rebalance_interval_s"))
    # A live run's rebalance actions, each at its instant (simulated seconds): given (a
    # tuple, even an empty one), they are applied then, and the rebalancer decides nothing
    # of its own (its rounds follow the live gateway's clock, not the simulation's).
    rebalance_log: tuple[tuple[float, RebalanceAction], ...] | None = None
    # A live run's engine scrapes (instant, worker name, metrics, the live gateway's own
    # requests in flight there then or None), each given to the pool at its instant as the
    # live gateway's health probe gave it: a worker's view counts its engine's running and
    # waiting requests at the last scrape beyond the gateway's own then (WorkerState.view).
    scrape_log: tuple[tuple[float, str, Mapping[str, float], int | None], ...] = ()
    # The engines as a live run's fleet began it (worker name, the metrics its gateway's
    # start-up probe round read: the requests the harness warmed each engine with, in its
    # histograms): the simulated engines start from those counters and the pool from those
    # scrapes, as the live gateway did; then the simulator's own probes go on from there.
    start_scrapes: tuple[tuple[str, Mapping[str, float]], ...] = ()
    # Without a scrape_log, the gateway scrapes each simulated worker's engine metrics this
    # often (simulated seconds; 0: never), the workers in turn, evenly apart, as its health
    # probes do.
    probe_interval_s: float = field(
        default_factory=lambda: _gateway_default("health_interval_s"))
    # A live run's pre-warms, per request by position in the trace: the worker the gateway
    # pre-warmed its prefix on at its decision ("" for none). Given (a tuple as long as the
    # trace), they are placed at those decisions and the pre-warmer decides none of its own:
    # whether its rule fires can turn on a request settling a moment sooner or later.
    prewarm_log: tuple[str, ...] = ()
    # Per request, where the blocks the pooled LRU would reuse went (SimResult.losses); costs
    # a lookup in every worker's cache per request.
    loss_breakdown: bool = False
    # When the engines let others reuse a request's new blocks (worker.kvcache.Reuse, the
    # reference worker's --cache-reuse): "scheduled" once the engine begins them, a reuser's
    # first token after their computation (vLLM's rule); "computed" once its prefill is done;
    # "admitted" from its admission on.
    reuse: str = "admitted"
    # Per request, by position in the trace: an earlier request whose answer it waits for
    # (-1: none), as an agent waits for its previous turn (the replay's --session-order:
    # loadtest.sessions.previous_in_session). A request waiting so holds one of the
    # ``concurrency`` slots, as a live sender does.
    after: tuple[int, ...] = ()
    # Per request, by position in the trace: seconds its sender waits after the answer it
    # follows (``after``) before sending it, holding its slot (loadtest.sessions.think_times).
    think_s: tuple[float, ...] = ()
    # Blocks each running request holds outside the prefix cache (an engine's partial last
    # block of the prompt, then its output): taken at admission, freed at completion, never
    # cached; the gateway's pool models them as the live gateway does with token-exact keys
    # (WorkerPool private_blocks).
    private_blocks: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.cache_blocks < 1 or self.max_running < 1:
            raise ValueError("workers, cache_blocks and max_running must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1 (or None: unbounded)")
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.mode not in ("sequential", "replay"):
            raise ValueError(f"unknown mode {self.mode!r}")
        if self.worker_names and len(set(self.worker_names)) != self.workers:
            raise ValueError("worker_names must name each worker once")
        if min(self.route_delay_s, self.relay_delay_s, self.rebalance_interval_s,
               self.key_blocks_per_block, self.private_blocks, self.probe_interval_s,
               self.copy_hold_s) < 0:
            raise ValueError("route_delay_s, relay_delay_s, rebalance_interval_s, "
                             "key_blocks_per_block, private_blocks, probe_interval_s and "
                             "copy_hold_s must be >= 0")


def gateway_key(key: PrefixKey, per_block: int,
                opts: FingerprintOptions | None = None) -> PrefixKey:
    """The gateway's fingerprint of a prompt whose trace blocks are ``key.blocks`` (dense, each
    naming its whole prefix, as trace block ids do) when each is ``per_block`` fingerprint
    blocks of text: the hashes at the gateway's checkpoint depths only
    (:func:`gateway.fingerprint.checkpoint_depths`, capped at ``max_blocks``) and the anchor at
    ``anchor_blocks``, as :func:`gateway.fingerprint.fingerprint` cuts the text."""
    opts = opts or FingerprintOptions()
    total = min(len(key.blocks) * per_block, opts.max_blocks)
    if total == 0:
        return key
    depths = checkpoint_depths(total, opts)
    if per_block == 1:
        blocks = [key.blocks[d - 1] for d in depths]
    else:  # fingerprint block j of trace block b names (b, j), hence the whole prefix too
        blocks = [xxhash.xxh3_64_intdigest(
            key.blocks[(d - 1) // per_block].to_bytes(8, "little")
            + ((d - 1) % per_block).to_bytes(4, "little")) for d in depths]
    anchor = blocks[max(0, bisect.bisect_right(depths, opts.anchor_blocks) - 1)]
    return PrefixKey(tuple(blocks), anchor, key.text_chars, tuple(depths))


def worker_ids(n: int, ring_seed: int = 0) -> list[str]:
    """The simulated workers' ids. They decide ring placement, so another ``ring_seed`` (another
    set of names: ``s3-w00``...) is another, equally likely, deployment of the same fleet."""
    width = len(str(n - 1))
    prefix = f"s{ring_seed}-w" if ring_seed else "w"
    return [f"{prefix}{i:0{width}d}" for i in range(n)]


@dataclass(frozen=True, slots=True)
class WorkerResult:
    id: str
    routed: int
    blocks: int
    matched_blocks: int
    uncached_blocks: int
    max_queue: int

    @property
    def hit_rate(self) -> float:
        return self.matched_blocks / self.blocks if self.blocks else 0.0


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    workers: int
    cache_blocks: int
    mode: Mode
    concurrency: int | None
    speedup: float
    requests: int
    rejected: int
    blocks: int
    matched_blocks: int
    predicted_blocks: int
    best_known_blocks: int
    ttft_s: tuple[float, ...]
    decision_us: tuple[float, ...]
    sim_seconds: float
    wall_seconds: float
    per_worker: tuple[WorkerResult, ...]
    # The worker each request went to, in trace order ("" for one rejected).
    assignments: tuple[str, ...] = ()
    # The blocks each request's worker reused, in trace order (-1 for one rejected): what the
    # live worker reports for it (x-cache-matched-tokens), to compare request by request.
    reused: tuple[int, ...] = ()
    # Decisions by label (Decision.label; "diverted:<why>" split out).
    reasons: Mapping[str, int] = field(default_factory=dict)
    ring_seed: int = 0
    # The rebalancer's actions by kind (shrink_capacity, grow_capacity, shed).
    rebalance: Mapping[str, int] = field(default_factory=dict)
    # With SimConfig.loss_breakdown, in blocks: "routed_elsewhere" (another worker held more
    # than the chosen one reused), "evicted_fleet_wide" (one pooled LRU of the fleet's size
    # would still hold what no worker did), "kept_longer" (the other way round).
    losses: Mapping[str, int] = field(default_factory=dict)
    prewarms: int = 0  # pre-warms the gateway's pre-warmer sent
    prewarms_used: int = 0  # ... that a later request for their prefix was routed to


@dataclass(slots=True)
class _Job:
    req: TraceRequest
    rid: str
    issued: float  # when the client sent it (TTFT counts from here)
    attempt: Attempt | None  # None: a pre-warm (the gateway's own prefill-only replay)
    settle_at: float | None = None  # with request_delays: decision + the request's hold
    pos: int = -1  # its position in the trace (-1: a pre-warm)
    matched_blocks: int = 0
    pooled_blocks: int = 0  # with loss_breakdown: what one pooled LRU would reuse
    best_blocks: int = 0  # ... and the most any worker held when it was routed
    private: Sequence[int] = ()  # hashes of its private blocks (SimConfig.private_blocks)
    arrived: float = 0.0  # when it reached the worker (the engine's histograms count from here)
    freed_at: float | None = None  # with engine_holds: when the live engine freed its blocks
    computed_at: float | None = None  # with engine_computed: when the live one computed them
    awaits: tuple[str, ...] = ()  # Reuse.SCHEDULED: requests computing blocks it reused
    waits: int = 0  # ... of which its first token still waits for this many
    copy_of: str = ""  # the volume guard's copy of a session: the worker it goes to
    copy_key: PrefixKey | None = None  # ... and the key it copies
    admitted: bool = False  # the engine took it in (what it reused is known)
    settled: bool = False  # the gateway had its reply


class _Telemetry:
    """The gateway's hit counters per worker, as its store accumulates the cache reports."""

    def __init__(self) -> None:
        self.workers: dict[str, HitCounters] = {}

    def assigned(self, key: PrefixKey, worker_id: str) -> None:
        return None

    def reported(self, report: CacheReport) -> None:
        self.workers.setdefault(report.worker_id, HitCounters()).add(report)

    def catch_up(self, now: float) -> None:
        return None  # one simulated gateway: nobody else decides


class _SimWorker:
    __slots__ = (
        "blocks", "cache", "compute", "compute_round", "first_token_s", "first_tokens",
        "in_prefill", "matched_blocks", "max_queue", "prefill_free_at", "queue", "queue_s",
        "routed", "running", "started", "worker",
    )

    def __init__(self, worker: Worker, cache: PrefixCache) -> None:
        self.worker = worker
        self.cache = cache
        self.queue: deque[_Job] = deque()
        self.running = 0
        self.prefill_free_at = 0.0
        self.routed = 0
        self.blocks = 0
        self.matched_blocks = 0
        self.max_queue = 0
        # The engine's histograms: requests admitted, and the sums of their admission waits
        # and times to first token.
        self.started = 0
        self.queue_s = 0.0
        self.first_tokens = 0
        self.first_token_s = 0.0
        # With SimCosts.prefill_shared: the engine's compute shared by the requests in
        # prefill (the worker's own bookkeeping), those requests by job number, and the
        # round of the timer set for the next prefill to end (an older timer is void).
        self.compute = ProcessorSharing()
        self.in_prefill: dict[int, _Job] = {}
        self.compute_round = 0

    def resume(self, metrics: Mapping[str, float]) -> None:
        """Start from the histograms of a live engine's scrape (``SimConfig.start_scrapes``):
        the requests it had admitted and their waits, so that the next probe's means are of
        the requests since, as the live gateway's are."""
        self.started = int(metrics.get(QUEUE_TIME_COUNT, 0.0))
        self.queue_s = metrics.get(QUEUE_TIME_SUM, 0.0)
        self.first_tokens = int(metrics.get(FIRST_TOKEN_TIME_COUNT, 0.0))
        self.first_token_s = metrics.get(FIRST_TOKEN_TIME_SUM, 0.0)

    def metrics(self) -> dict[str, float]:
        """What the engine's ``/metrics`` says now, as the gateway's probe reads it."""
        return {RUNNING: float(self.running), WAITING: float(len(self.queue)),
                QUEUE_TIME_SUM: self.queue_s, QUEUE_TIME_COUNT: float(self.started),
                FIRST_TOKEN_TIME_SUM: self.first_token_s,
                FIRST_TOKEN_TIME_COUNT: float(self.first_tokens)}

    def result(self) -> WorkerResult:
        return WorkerResult(self.worker.id, self.routed, self.blocks, self.matched_blocks,
                            self.blocks - self.matched_blocks, self.max_queue)


class ClusterSim:
    """One run of one policy over one trace (see module docstring). Use :func:`simulate`."""

    def __init__(self, config: SimConfig, router: Router | None = None) -> None:
        self.config = config
        ids = list(config.worker_names) or worker_ids(config.workers, config.ring_seed)
        caches = {wid: PrefixCache(config.cache_blocks, 1, reuse=config.reuse)
                  for wid in ids}
        # Under Reuse.SCHEDULED: per request still computing blocks others reused, what runs
        # once it computed them (the first tokens of those others).
        self._computing: dict[str, list[Callable[[float], None]]] = {}
        # The volume guard's session copies run at a background priority: the index records
        # each once it is done (WarmPrompt.recorded_at_answer), else when it is sent.
        self._background_copies = config.copy_priority > 0 and config.priority_engines
        self.workers = {wid: _SimWorker(Worker(wid, f"sim://{wid}"), caches[wid]) for wid in ids}
        self.index = PrefixIndex(config.index_capacity, config.index_ttl_s)
        self.pool = WorkerPool((), self.index, private_blocks=config.private_blocks)
        self._private = 0  # private blocks handed out so far (their ids: negative)
        self._prefill_jobs = 0  # prefills started on shared compute so far (their numbers)
        for wid in ids:
            self.pool.add(f"sim://{wid}", wid=wid)
            self.pool.mark_up(wid, frozenset())
            # Engines on priority scheduling run copies at the priority they are sent with,
            # as the gateway's probe finds.
            self.pool.set_copies_yield(wid, config.copy_priority > 0 and config.priority_engines)
            if config.index_knows_capacity:
                # As the gateway does once a worker reports its cache size (gateway.sync).
                self.pool.set_capacity(wid, config.cache_blocks)
        for wid, metrics in config.start_scrapes:  # the gateway's start-up probe round
            if wid in self.workers:
                self.workers[wid].resume(metrics)
                self.pool.mark_up(wid, frozenset(), metrics)
        router = router or build_router(config.policy, caches, config.policy_options)
        opts = config.policy_options
        self.prewarmer = PreWarmer(self.pool, self.index, _no_replay, PrewarmOptions(
            enabled=config.prewarm,
            hot_threshold=opts.hot_threshold or PrewarmOptions().hot_threshold,
            fraction=float(GatewaySettings().prewarm_fraction), wait_weight=opts.wait_weight))
        self._prewarms = 0  # pre-warms under way
        self.telemetry = _Telemetry()
        self.session = RoutingSession(router, self.index, self.pool, self.telemetry)
        self.rebalancer = Rebalancer(
            MemoryStore(), self.pool, self.index, "sim",
            RebalanceOptions(interval_s=config.rebalance_interval_s or 1.0))
        self._next_rebalance = config.rebalance_interval_s or math.inf
        self._rebalance_actions: Counter[str] = Counter()
        # (time, sequence, what happens then): worker completions, delayed decisions, settling.
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        if config.rebalance_log is not None:  # the live run's own actions, at their instants
            self._next_rebalance = math.inf
            for at, logged in config.rebalance_log:
                self._at(at, functools.partial(self._apply_logged, logged))
        for at, name, metrics, own in config.scrape_log:
            self._at(at, functools.partial(self._scraped, name, metrics, own))
        # The health probes, one worker after another (in the order of their names), each
        # once per interval.
        self._probe_order = sorted(ids)
        self._probe_step = config.probe_interval_s / max(1, len(ids))
        self._probe_turn = 0
        # The first round starts an interval after the start (when the gateway's start-up
        # round probed every worker).
        self._next_probe = (config.probe_interval_s + self._probe_step
                            if config.probe_interval_s and not config.scrape_log else math.inf)
        self._inflight = 0
        # With ``after``: requests answered, and those holding a slot until an answer (by the
        # position of the request they wait for).
        self._answered: set[int] = set()
        self._waiting: dict[int, list[tuple[int, TraceRequest]]] = {}
        self._answered_at: dict[int, float] = {}  # with think_s: when each was answered
        self._held = 0
        self._last_decision = -math.inf  # the gateway decides in the order requests reach it
        self._ttft: list[float] = []
        self._decision_us: list[float] = []
        self._predicted = 0
        self._best_known = 0
        self._rejected = 0
        self._assignments: dict[int, str] = {}  # trace position -> worker
        self._reused: dict[int, int] = {}  # trace position -> blocks its worker reused
        self._reasons: Counter[str] = Counter()
        self._pooled = (PrefixCache(config.cache_blocks * len(ids), 1)
                        if config.loss_breakdown else None)
        self._losses: Counter[str] = Counter()

    @property
    def router(self) -> Router:
        return self.session.router

    def _at(self, t: float, action: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, action))

    # -- client side ----------------------------------------------------------------------------

    def _issue(self, pos: int, req: TraceRequest, now: float) -> None:
        if len(req.blocks) + self.config.private_blocks > self.config.cache_blocks:
            self._rejected += 1  # can never fit in one worker's cache
            self._answer(pos, now)
            return
        self._inflight += 1
        timed = self.config.request_delays
        delay, hold = timed[pos % len(timed)] if timed else (self.config.route_delay_s, None)
        keys = self.config.route_keys
        key = keys[pos] if pos < len(keys) else None
        gap = self.config.decision_gap_s
        if delay > 0 or gap > 0:
            # One event loop decides in arrival order, one request at a time: a request sent
            # later is never decided before one sent earlier, however their waits differ.
            at = max(now + delay, self._last_decision + gap)
            self._last_decision = at
            self._at(at, lambda t: self._dispatch(req, t, now, hold, key, pos))
        else:
            self._dispatch(req, now, now, hold, key, pos)

    # -- gateway side ---------------------------------------------------------------------------

    def _dispatch(self, req: TraceRequest, now: float, issued: float,
                  hold: float | None, key: PrefixKey | None, pos: int) -> None:
        per_block = self.config.key_blocks_per_block
        if key is None:
            key = gateway_key(req.key, per_block) if per_block else req.key
        route_request = RouteRequest(
            key=key, model=MODEL, cost_tokens=req.cost_tokens, prompt_tokens=req.input_tokens
        )
        per_block = per_block or 1
        pooled = best = 0
        if self._pooled is not None:  # diagnostic, untimed: before this request is placed
            best = max(w.cache.lookup(req.blocks) for w in self.workers.values())
            pooled = self._pooled.allocate("r", req.blocks).matched_blocks
            self._pooled.release("r")
        if self.router.uses_prefix_index:
            # Diagnostic, untimed: the deepest prefix any worker was known to hold.
            held = max(self.index.match(key.blocks, now).values(), default=0)
            self._best_known += key.depth_at(held - 1) // per_block if held else 0
        t0 = time.perf_counter()
        attempt = self.session.route(route_request, now)
        self._decision_us.append((time.perf_counter() - t0) * 1e6)
        decision = attempt.decision
        self._predicted += decision.match_blocks // per_block
        self._reasons[_reason_label(decision)] += 1
        w = self.workers[decision.worker_id]
        self._assignments[pos] = w.worker.id
        w.routed += 1
        freed, computed = self.config.engine_holds, self.config.engine_computed
        job = _Job(req, str(req.index), issued, attempt, None if hold is None else now + hold,
                   pos, pooled_blocks=pooled, best_blocks=best, arrived=now,
                   freed_at=now + freed[pos] if pos < len(freed) else None,
                   computed_at=now + computed[pos] if pos < len(computed) else None)
        w.queue.append(job)
        if job.settle_at is not None and self.config.mode == "replay":
            self._at(job.settle_at, functools.partial(self._hold_ended, job))
        w.max_queue = max(w.max_queue, len(w.queue))
        if self.router.uses_prefix_index:  # as the gateway does after each decision
            logged = self.config.prewarm_log
            if logged and self.config.prewarm:
                placed = logged[pos] if logged[pos] in self.workers else ""
                target = self.prewarmer.replayed(decision, route_request, now, placed)
            else:
                target = self.prewarmer.target(decision, route_request, now, self._prewarms)
            if target is not None:
                session = bool(decision.copy_to)  # the volume guard's copy: whole
                if self.config.prewarm_cut and not session:
                    key = held_prefix(key, decision.match_blocks, 1)
                self._prewarm(target, req, key, now, hold, session)
        self._pump(w, now)

    def _prewarm(self, wid: str, req: TraceRequest, key: PrefixKey, now: float,
                 hold: float | None, session: bool = False) -> None:
        """The gateway's pre-warm of ``req``'s held prefix (``key``, cut by
        :func:`~gateway.prewarm.held_prefix`) on ``wid``: recorded in the index as it is sent,
        replayed there prefill-only (its trace blocks within the cut; it takes cache blocks as
        any request does, and counts in no client figure), one of the pre-warmer's slots held
        for as long as the request that caused it was. ``session``: the volume guard's copy of
        a session, whose end the pre-warmer is told (``PreWarmer.copied``); at a background
        priority recorded in the index when it is done, as the gateway records it at its
        answer (``WarmPrompt.recorded_at_answer``)."""
        if not session or not self._background_copies:  # else once it is done
            self.index.record(key.blocks, wid, now, key.depths)
        self._prewarms += 1
        w = self.workers[wid]
        copied = req
        blocks = key.total_blocks // (self.config.key_blocks_per_block or 1)
        if 0 < blocks < len(req.blocks):
            tokens = max(1, req.input_tokens * blocks // len(req.blocks))
            chars = req.key.text_chars * blocks // len(req.blocks)
            copied = replace(req, input_tokens=tokens, key=req.key.cut(blocks, chars))
        settle_at = None if hold is None else now + hold
        if session and self.config.copy_hold_s > 0:
            settle_at = now + self.config.copy_hold_s
        w.queue.append(_Job(replace(copied, output_tokens=1), f"prewarm-{self.prewarmer.sent}",
                            now, None, settle_at, arrived=now, copy_of=wid if session else "",
                            copy_key=key if session else None))
        self._pump(w, now)

    def _hold_ended(self, job: _Job, now: float) -> None:
        """At the live gateway's decision instants (mode "replay" with each request's hold):
        the live gateway had ``job``'s reply at ``now``, so it is settled then, as the gateway's
        own count of requests in flight had it, even while the simulated engine is still
        running it. The cost model runs longer than the live engine did where prefills share
        compute (RAG: 29% of requests sent elsewhere, the first where a request the live
        gateway had settled 0.6 ms before still counted in flight). One the engine has not
        taken in yet is settled when it ends: what it reused is not known before. From the
        client's timing the engine's end stays in the loop: the client simulated there sends
        its next request on the answer, which cannot come before the engine is done."""
        if job.admitted:
            self._settled(job, now)

    def _settle(self, job: _Job) -> None:
        # What the worker reports, in blocks (one trace block = one cache block).
        assert job.attempt is not None
        self.session.completed(job.attempt, CacheUsage(len(job.req.blocks), job.matched_blocks))
        self._inflight -= 1

    def _scraped(self, name: str, metrics: Mapping[str, float], own: int | None,
                 now: float) -> None:
        self.pool.mark_up(name, frozenset(), metrics, own)

    def _probe(self) -> None:
        """The gateway's next health probe: one engine's metrics."""
        wid = self._probe_order[self._probe_turn % len(self._probe_order)]
        self._probe_turn += 1
        self.pool.mark_up(wid, frozenset(), self.workers[wid].metrics())

    def _apply_logged(self, action: RebalanceAction, now: float) -> None:
        self._rebalance_actions[action.action] += 1
        self.rebalancer.apply(action)

    def _rebalance(self) -> None:
        """One round of the gateway's rebalancer over the hit counters so far."""
        for action in self.rebalancer.decide(self.telemetry.workers):
            self._rebalance_actions[action.action] += 1
            self.rebalancer.apply(action)

    # -- worker side ----------------------------------------------------------------------------

    def _pump(self, w: _SimWorker, now: float) -> None:
        """Admit queued requests in FIFO order while slots and blocks allow."""
        costs = self.config.costs
        private = self.config.private_blocks
        while w.queue and w.running < self.config.max_running:
            job = w.queue[0]
            held = job.req.blocks
            if private:  # ids no prompt has: never matched, freed at completion
                held = (*held, *range(-self._private - 1, -self._private - 1 - private, -1))
            try:
                alloc = w.cache.allocate(job.rid, held)
            except CacheFullError:
                return
            if private:
                self._private += private
                job.private = w.cache.hashes(held)[-private:]
            w.queue.popleft()
            w.running += 1
            job.admitted = True
            req = job.req
            job.matched_blocks = alloc.matched_blocks
            job.awaits = alloc.awaits  # empty but under Reuse.SCHEDULED
            if job.attempt is not None:  # a client's request, not a pre-warm
                self._reused[job.pos] = alloc.matched_blocks
                w.blocks += len(req.blocks)
                w.matched_blocks += alloc.matched_blocks
                if self._pooled is not None:
                    self._count_losses(job)
            cached = min(alloc.matched_blocks * self.config.block_tokens, req.input_tokens)
            prefill = costs.prefill_seconds(req.input_tokens - cached, cached)
            w.started += 1
            w.queue_s += now - job.arrived
            if costs.prefill_shared and prefill > 0.0:
                self._prefill_jobs += 1
                w.in_prefill[self._prefill_jobs] = job
                priority = (self.config.copy_priority
                            if job.copy_of and self.config.priority_engines else 0)
                self._prefilled(w, w.compute.add(self._prefill_jobs, prefill, now, priority),
                                now)
                continue
            start = max(now, w.prefill_free_at) if self.config.serial_prefill else now
            first_token = start + prefill
            if self.config.serial_prefill:
                w.prefill_free_at = first_token
            if start > now:
                self._at(start, functools.partial(self._started, w, job.rid))
            else:
                w.cache.started(job.rid)
            if job.awaits:  # whether they are done is known only then
                self._at(first_token, functools.partial(self._prefill_done, w, job))
            else:
                self._first_token_at(w, job, first_token)

    def _prefilled(self, w: _SimWorker, done: Sequence[int], now: float) -> None:
        """Shared prefill compute: the jobs ``done`` by ``now`` have their first token; the
        timer is set again for the next one to end (the requests still in prefill share the
        engine among fewer)."""
        for number in w.compute.begun():
            w.cache.started(w.in_prefill[number].rid)
        for number in done:
            self._prefill_done(w, w.in_prefill.pop(number), now)
        w.compute_round += 1
        end = w.compute.next_end()
        if end is not None:
            self._at(end, functools.partial(self._compute_tick, w, w.compute_round))

    def _compute_tick(self, w: _SimWorker, round_: int, now: float) -> None:
        if round_ == w.compute_round:  # else a request started since: a later timer is set
            self._prefilled(w, w.compute.advance(now), now)

    def _started(self, w: _SimWorker, rid: str, now: float) -> None:
        w.cache.started(rid)

    def _prefill_done(self, w: _SimWorker, job: _Job, now: float) -> None:
        """``job``'s own prefill is done at ``now``: its first token, once the requests
        computing blocks it reused are done with them (Reuse.SCHEDULED)."""
        w.cache.started(job.rid)  # a job done in the call that began it
        waiting = [rid for rid in job.awaits if w.cache.computing(rid)]
        if not waiting:
            self._first_token_at(w, job, now)
            return
        job.waits = len(waiting)
        for rid in waiting:
            self._computing.setdefault(rid, []).append(functools.partial(self._awaited, w, job))

    def _awaited(self, w: _SimWorker, job: _Job, now: float) -> None:
        job.waits -= 1
        if job.waits == 0:
            self._first_token_at(w, job, now)

    def _computed(self, w: _SimWorker, rid: str, now: float) -> None:
        """Request ``rid`` computed its blocks: the requests waiting for them go on."""
        w.cache.computed(rid)
        for then in self._computing.pop(rid, ()):
            then(now)

    def _first_token_at(self, w: _SimWorker, job: _Job, first_token: float) -> None:
        """``job``'s prefill ends at ``first_token``: its first token, then its decode."""
        if job.attempt is not None:
            self._ttft.append(first_token - job.issued)
        w.first_tokens += 1
        w.first_token_s += first_token - job.arrived
        if self.config.streaming and job.attempt is not None:
            self._at(first_token, functools.partial(self._first_token, job.attempt))
        if self.config.reuse != Reuse.ADMITTED:  # its blocks count as computed from then on
            at = first_token if job.computed_at is None else max(first_token, job.computed_at)
            self._at(at, functools.partial(self._computed, w, job.rid))
        # The engine frees the blocks when its own work is done (when the live one did, with
        # engine_holds); the gateway settles the request when its reply came back
        # (``_complete``: its live hold, with request_delays; at the live decision instants
        # ``_hold_ended``, however long the engine here still runs it).
        done = first_token + self.config.costs.decode_seconds(job.req.output_tokens)
        if job.freed_at is not None:
            done = max(done, job.freed_at)
        self._at(done, functools.partial(self._complete, w, job))

    def _count_losses(self, job: _Job) -> None:
        best, pooled = job.best_blocks, job.pooled_blocks
        self._losses["routed_elsewhere"] += max(0, best - job.matched_blocks)
        self._losses["evicted_fleet_wide"] += max(0, pooled - best)
        self._losses["kept_longer"] += max(0, best - pooled)

    def _first_token(self, attempt: Attempt, now: float) -> None:
        self.session.first_token(attempt)

    def _complete(self, w: _SimWorker, job: _Job, now: float) -> None:
        if w.cache.computing(job.rid):  # its blocks count as computed when it ends
            self._computed(w, job.rid, now)
        w.cache.release(job.rid)
        for h in job.private:  # freed, as an engine frees a partial block
            w.cache.discard(h)
        w.running -= 1
        at = (now + self.config.relay_delay_s if job.settle_at is None
              else max(now, job.settle_at))
        if at > now:
            self._at(at, lambda t: self._settled(job, t))
        else:
            self._settled(job, now)
        self._pump(w, now)

    def _settled(self, job: _Job, now: float) -> None:
        if job.settled:  # at its live hold's end already (_hold_ended)
            return
        job.settled = True
        if job.attempt is not None:
            self._settle(job)
            self._answer(job.pos, now)
        else:
            self._prewarmed(job, now)

    def _answer(self, pos: int, now: float) -> None:
        """Request ``pos`` is answered at ``now``: the requests waiting for it are sent."""
        if not self.config.after:
            return
        self._answered.add(pos)
        think = self.config.think_s
        if think:
            self._answered_at[pos] = now
        for waiting in self._waiting.pop(pos, ()):
            gap = think[waiting[0]] if waiting[0] < len(think) else 0.0
            if gap > 0.0:
                self._at(now + gap, functools.partial(self._issue_held, *waiting))
            else:
                self._held -= 1
                self._issue(*waiting, now)

    def _issue_held(self, pos: int, req: TraceRequest, now: float) -> None:
        """A request whose sender waited out its think time after the answer it followed."""
        self._held -= 1
        self._issue(pos, req, now)

    def _prewarmed(self, job: _Job, now: float) -> None:
        self._prewarms -= 1
        if job.copy_of and job.copy_key is not None:
            key = job.copy_key
            if self._background_copies:
                self.index.record(key.blocks, job.copy_of, now, key.depths)
            self.prewarmer.copied(job.copy_of, key)

    # -- the event loop -------------------------------------------------------------------------

    def run(self, requests: Sequence[TraceRequest]) -> SimResult:
        cfg = self.config
        started = time.perf_counter()
        limit = cfg.concurrency if cfg.concurrency is not None else math.inf
        ready: deque[tuple[int, TraceRequest]] = deque()
        events = self._events
        now = 0.0
        i, n = 0, len(requests)
        while True:
            if i < n:
                t_arrival = 0.0 if cfg.mode == "sequential" else requests[i].arrival_s / cfg.speedup
            else:
                t_arrival = math.inf
            t_event = events[0][0] if events else math.inf
            while self._next_rebalance <= min(t_event, t_arrival) < math.inf:
                self._rebalance()
                self._next_rebalance += cfg.rebalance_interval_s
            while self._next_probe <= min(t_event, t_arrival) < math.inf:
                self._probe()
                self._next_probe += self._probe_step
            if events and t_event <= t_arrival:
                now, _, action = heapq.heappop(events)
                action(now)
            elif i < n:
                now = max(now, t_arrival)
                ready.append((i, requests[i]))
                i += 1
            else:
                break
            while ready and self._inflight + self._held < limit:
                pos, req = ready.popleft()
                before = cfg.after[pos] if pos < len(cfg.after) else -1
                if before >= 0 and before not in self._answered:
                    self._held += 1  # its sender waits for that answer
                    self._waiting.setdefault(before, []).append((pos, req))
                elif before >= 0 and pos < len(cfg.think_s) and (
                        due := self._answered_at[before] + cfg.think_s[pos]) > now:
                    self._held += 1  # ... and then its think time
                    self._at(due, functools.partial(self._issue_held, pos, req))
                else:
                    self._issue(pos, req, now)
        blocked = [w.worker.id for w in self.workers.values() if w.queue]
        if blocked:  # cannot happen: a lone request always fits an empty cache
            raise RuntimeError(f"requests left queued on {blocked}")
        per_worker = tuple(w.result() for w in self.workers.values())
        return SimResult(
            policy=cfg.policy, workers=cfg.workers, cache_blocks=cfg.cache_blocks,
            mode=cfg.mode, concurrency=cfg.concurrency, speedup=cfg.speedup,
            requests=n - self._rejected, rejected=self._rejected,
            blocks=sum(w.blocks for w in per_worker),
            matched_blocks=sum(w.matched_blocks for w in per_worker),
            predicted_blocks=self._predicted, best_known_blocks=self._best_known,
            ttft_s=tuple(self._ttft), decision_us=tuple(self._decision_us),
            sim_seconds=now,
            wall_seconds=time.perf_counter() - started, per_worker=per_worker,
            assignments=tuple(self._assignments.get(i, "") for i in range(n)),
            reused=tuple(self._reused.get(i, -1) for i in range(n)),
            reasons=dict(self._reasons),
            ring_seed=cfg.ring_seed, rebalance=dict(self._rebalance_actions),
            losses=dict(self._losses) if self._pooled is not None else {},
            prewarms=self.prewarmer.sent, prewarms_used=self.prewarmer.used,
        )


async def _no_replay(wid: str, prompt: WarmPrompt,
                     later: Coroutine[Any, Any, WarmPrompt] | None = None) -> bool:
    """The simulator replays pre-warms itself (:meth:`ClusterSim._prewarm`)."""
    return False


def _reason_label(decision: Decision) -> str:
    if decision.kind is DecisionKind.DIVERTED:
        return f"{decision.label}:{decision.diverted_by}"
    return decision.label


def simulate(requests: Sequence[TraceRequest], config: SimConfig) -> SimResult:
    """Run ``requests`` through a fresh simulated cluster under ``config``."""
    return ClusterSim(config).run(requests)


def pooled_bound(requests: Sequence[TraceRequest], total_blocks: int) -> float:
    """Block hit rate of the same sequence through ONE cache of ``total_blocks`` blocks.

    Sequential: each request allocates (reusing its longest cached prefix, LRU eviction) and is
    released at once. This is the "pooled single cache" bound of the hit rate a cluster of that
    total capacity can reach with LRU caches and no concurrency.
    """
    cache = PrefixCache(total_blocks, 1)
    matched = total = 0
    for req in requests:
        if len(req.blocks) > total_blocks:
            continue
        alloc = cache.allocate("r", req.blocks)
        cache.release("r")
        matched += alloc.matched_blocks
        total += len(req.blocks)
    return matched / total if total else 0.0
