"""The bookkeeping around one routing decision, shared by the live gateway and the simulator.

A :class:`RoutingSession` owns what happens around ``engine.route``: it reads a snapshot of
the pool at the time it is given (``now`` is an argument, never a clock it reads), records the
decision in the prefix index, publishes it to the other gateway replicas, counts the request in
flight on the chosen worker, and settles the attempt exactly once: :meth:`RoutingSession.failed`
undoes the prediction (the worker never got the prompt) and :meth:`RoutingSession.completed`
counts what the worker reported it reused. :meth:`RoutingSession.route` decides and accounts
in one call; ``gateway.proxy`` calls its two halves, :meth:`RoutingSession.decide` and
:meth:`RoutingSession.commit`, around the write to the worker, with nothing awaited between
them, so it accounts for each decision before any other is made, as ``route`` does. It runs
with ``time.monotonic()`` around a real backend; ``loadtest.sim`` runs the same object on
simulated time, so the two route alike by construction.

No I/O and no aiohttp here: publishing goes to an :class:`AssignmentSink` (the store sync
buffers it for its background loops).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.fingerprint import PrefixKey
from gateway.kvevents.hybrid import HybridMatcher
from gateway.kvevents.index import ExactMatcher
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Decision, DecisionKind, PrefixMatcher, RouteRequest, Snapshot
from gateway.store.base import CacheReport
from gateway.values import value


class Router(Protocol):
    """What decides: a routing engine (or, in the simulator, a reference router)."""

    @property
    def name(self) -> str: ...

    @property
    def uses_prefix_index(self) -> bool: ...

    def route(
        self, request: RouteRequest, snapshot: Snapshot, exclude: frozenset[str] = ...
    ) -> Decision: ...


class AssignmentSink(Protocol):
    """Where decisions and cache reports go to be shared (the store sync, or nowhere)."""

    def assigned(self, key: PrefixKey, worker_id: str) -> None: ...

    def reported(self, report: CacheReport) -> None: ...

    def catch_up(self, now: float) -> None:
        """Take in, at time ``now``, what other gateways decided and the sink can tell
        without waiting (called right before each decision)."""
        ...


class SentBlocks(Protocol):
    """Told which blocks went to which worker (the engine-exact index, awaiting its events)."""

    def sent(self, worker_id: str, blocks: Sequence[int], now: float) -> None: ...

    def unsent(self, worker_id: str, blocks: Sequence[int]) -> None: ...

    def done(self, worker_id: str, blocks: Sequence[int], now: float) -> None:
        """The request that carried ``blocks`` there ended (answered or failed)."""
        ...


class NoSink:
    """Shares nothing: a single gateway with no store, or the simulator."""

    def assigned(self, key: PrefixKey, worker_id: str) -> None:
        return None

    def reported(self, report: CacheReport) -> None:
        return None

    def catch_up(self, now: float) -> None:
        return None


@value
class CacheUsage:
    """What a worker said it reused: prompt tokens, and how many came from its prefix cache."""

    input_tokens: int
    matched_tokens: int


@dataclass(slots=True)
class Attempt:
    """One routed attempt of one request; settled once, by ``failed`` or ``completed``."""

    request: RouteRequest
    decision: Decision
    tenant: str = ""
    # With token-exact keys: prompt tokens the chosen worker should find cached (the leading
    # blocks its index source says it holds, not floored by the policy's minimum match).
    predicted_tokens: int | None = None
    settled: bool = False
    committed: bool = False  # accounted for (RoutingSession.commit)
    index: PrefixMatcher | None = None  # the prefix index as the decision saw it
    prefill_tokens: int = 0  # prompt tokens the worker is predicted to compute (not cached)
    ticket: int = 0  # its entry among the worker's requests in flight (WorkerPool.acquire)
    prefilled: bool = False  # its first token came back: the prefill no longer queues
    at: float = 0.0  # when it was routed
    # When the chosen worker had last used the deepest prefix it was predicted to hold
    # (PrefixIndex.last_use, before this attempt was recorded); 0: none.
    held_use: int = 0
    # The worker this decision also pre-warmed the prefix on (gateway.prewarm); "": none.
    prewarmed_to: str = ""

    @property
    def worker_id(self) -> str:
        return self.decision.worker_id

    @property
    def queued_prefill(self) -> int:
        """Prefill tokens of this attempt still counted in its worker's queue."""
        return 0 if self.prefilled else self.prefill_tokens


def predicted_tokens(snapshot: Snapshot, request: RouteRequest, decision: Decision) -> int | None:
    """Prompt tokens the chosen worker should find cached: with token-exact keys, the leading
    blocks its index source says it holds (not floored by the policy's minimum match; for vLLM
    never the whole prompt); None with character keys, whose prediction is scaled from the
    worker's reply (:meth:`RoutingSession.completed`)."""
    if not request.block_tokens:
        return None
    index, wid = snapshot.index, decision.worker_id
    if isinstance(index, ExactMatcher | HybridMatcher):
        held = index.held(wid, request.key.blocks)  # checkpoints
    else:
        held = index.match(request.key.blocks).get(wid, 0)
    depth = request.key.depth_at(held - 1) if held else 0
    if decision.worker.worker.kind == "vllm":
        # vLLM computes at least the last prompt token: a fully cached prompt reports one
        # block less.
        depth = min(depth, max(0, request.prompt_tokens - 1) // request.block_tokens)
    return depth * request.block_tokens


class RoutingSession:
    def __init__(
        self,
        router: Router,
        index: PrefixIndex,
        pool: WorkerPool,
        sink: AssignmentSink | None = None,
        exact: SentBlocks | None = None,
        learn_capacity: bool = True,
        fleet_prior: bool = True,
    ) -> None:
        self.router = router
        self.index = index
        self.pool = pool
        self.sink: AssignmentSink = sink if sink is not None else NoSink()
        self.exact = exact
        self.learn_capacity = learn_capacity
        self.fleet_prior = fleet_prior

    def route(
        self,
        request: RouteRequest,
        now: float,
        exclude: frozenset[str] = frozenset(),
        tenant: str = "",
        observe: Callable[[Decision, PrefixMatcher], None] | None = None,
        pinned: str = "",
    ) -> Attempt:
        """Decide at time ``now`` and account for it (:meth:`decide`, then :meth:`commit`);
        raises ``NoCandidates`` when no worker may take the request."""
        attempt = self.decide(request, now, exclude, tenant, observe)
        self.commit(attempt)
        return attempt

    def decide(
        self,
        request: RouteRequest,
        now: float,
        exclude: frozenset[str] = frozenset(),
        tenant: str = "",
        observe: Callable[[Decision, PrefixMatcher], None] | None = None,
        pinned: str = "",
    ) -> Attempt:
        """The decision at time ``now``, not yet accounted for: the index and the pool are as
        before until :meth:`commit`. The caller commits before it next yields to the event
        loop, so every later decision sees this one exactly as after :meth:`route`; in
        between it may write the request to the worker (the gateway does: the worker starts
        on it while the gateway records it). ``pinned``: why ``exclude`` left a single worker
        (the decision's kind is then PINNED)."""
        self.sink.catch_up(now)
        snapshot = self.pool.snapshot(now)
        decision = self.router.route(request, snapshot, exclude)
        if pinned:  # ``exclude`` left one worker, which holds what the request names
            decision = replace(decision, kind=DecisionKind.PINNED, placement=pinned)
        if observe is not None:  # sees the index as the decision did, before it is recorded
            observe(decision, snapshot.index)
        key = request.key
        held_use = 0
        if self.router.uses_prefix_index and decision.match_blocks and self.learn_capacity:
            deepest = key.checkpoints_within(decision.match_blocks)
            if deepest:
                held_use = self.index.last_use(decision.worker_id, key.blocks[deepest - 1])
        total = key.total_blocks
        cached = request.prompt_tokens * decision.match_blocks // total if total else 0
        return Attempt(request, decision, tenant, predicted_tokens(snapshot, request, decision),
                       index=snapshot.index, prefill_tokens=max(0, request.prompt_tokens - cached),
                       at=now, held_use=held_use)

    def commit(self, attempt: Attempt) -> None:
        """Account for a decision of :meth:`decide`, once: record it in the prefix index (at
        the time it was decided), publish it, and count the request in flight on its worker.
        An attempt settled before it was committed is never committed."""
        if attempt.committed or attempt.settled:
            return
        attempt.committed = True
        request, wid, now = attempt.request, attempt.worker_id, attempt.at
        key = request.key
        blocks = key.blocks
        if self.router.uses_prefix_index:
            self.index.record(blocks, wid, now, key.depths)
            self.sink.assigned(key, wid)
            if self.exact is not None:
                self.exact.sent(wid, blocks, now)
        cached = request.prompt_tokens - attempt.prefill_tokens
        attempt.ticket = self.pool.acquire(wid, request.cost_tokens, attempt.prefill_tokens,
                                           (blocks, cached))

    def first_token(self, attempt: Attempt) -> None:
        """The worker sent the first token (a streamed reply): its prefill is done, so it no
        longer counts in the queue a new prefill would wait behind. Once per attempt."""
        if attempt.settled or attempt.prefilled or not attempt.committed:
            return
        attempt.prefilled = True
        self.pool.prefilled(attempt.worker_id, attempt.prefill_tokens)

    def failed(self, attempt: Attempt, now: float | None = None) -> None:
        """The worker never got the prompt: it holds no more of the prefix than before.
        ``now``: when the attempt ended (None: the time it was routed)."""
        if attempt.settled:
            return
        attempt.settled = True
        if not attempt.committed:  # never accounted for: nothing to undo
            return
        key = attempt.request.key
        depth = attempt.decision.match_blocks
        keep = key.checkpoints_within(depth)
        self.index.forget(attempt.worker_id, key.blocks, keep)
        if self.exact is not None and self.router.uses_prefix_index:
            self.exact.done(attempt.worker_id, key.blocks, attempt.at if now is None else now)
            self.exact.unsent(attempt.worker_id, key.blocks[keep:])
        self.pool.release(attempt.worker_id, attempt.request.cost_tokens, attempt.queued_prefill,
                          attempt.ticket)

    def completed(
        self, attempt: Attempt, usage: CacheUsage | None = None, now: float | None = None
    ) -> None:
        """The worker answered; ``usage`` is what it reported reusing (None: it reports
        nothing we can read, or the client went away before the end). ``now``: when it
        answered (None: the time it was routed)."""
        if attempt.settled:
            return
        attempt.settled = True
        if not attempt.committed:
            return
        wid = attempt.worker_id
        if self.exact is not None and self.router.uses_prefix_index:
            self.exact.done(wid, attempt.request.key.blocks,
                            attempt.at if now is None else now)
        if usage is not None:
            self.pool.record_cache_stats(wid, usage.input_tokens, usage.matched_tokens)
            blocks = attempt.request.key.total_blocks
            depth = attempt.decision.match_blocks
            predicted = attempt.predicted_tokens
            if predicted is None:  # character keys: scaled from the worker's count
                predicted = round(usage.input_tokens * depth / blocks) if blocks else 0
            self.pool.record_prediction(wid, predicted, usage.matched_tokens)
            if self.learn_capacity and blocks and usage.input_tokens > 0:
                share = min(usage.matched_tokens / usage.input_tokens, 1.0)
                self._learn(wid, blocks, depth, round(blocks * share), attempt.held_use)
            self.sink.reported(CacheReport(
                worker_id=wid,
                tenant=attempt.tenant,
                input_tokens=usage.input_tokens,
                matched_tokens=usage.matched_tokens,
                predicted_tokens=predicted,
            ))
        self.pool.release(wid, attempt.request.cost_tokens, attempt.queued_prefill,
                          attempt.ticket)

    def _learn(
        self, wid: str, blocks: int, predicted: int, matched: int, held_use: int = 0
    ) -> None:
        """Fit the modelled cache of a worker that does not report its size to what it reused
        (``predicted`` and ``matched`` leading blocks of a ``blocks``-block prompt).

        It reused less than the index said it held: its LRU already evicted that part, and
        with it everything it had used less recently than that prefix (last used at
        ``held_use``, :meth:`PrefixIndex.last_use`). The index drops those, and the model
        shrinks to what is left, less the part found evicted: at most what the worker can
        hold, since it had to evict the prefix to make room for the rest. Never in one step
        below half of what it held (one miss may have another cause), nor below this prompt;
        with no use known, to 90 % of what it held. It reused more while the model was full:
        the model evicted too early; it grows by the surprise. Small differences (a
        checkpoint's granularity, 2 % of the prompt) say nothing. Workers that report their
        size keep it (the rebalancer corrects those from the shared hit telemetry)."""
        if wid not in self.pool or self.pool.get(wid).capacity_blocks > 0:
            return
        slack = max(1, blocks // 50)
        index = self.index
        if matched + slack < predicted:
            held = index.held_blocks(wid)
            if held_use:
                left = index.evict_used_before(wid, held_use, floor=held // 2)
                fits = max(held // 2, min(left, held - (predicted - matched)))
            else:
                fits = held * 9 // 10
            index.set_capacity(wid, max(blocks, min(index.capacity(wid), fits)))
            if self.fleet_prior:
                self._share_learnt(wid)
        elif matched > predicted + slack and index.capacity(wid) <= index.held_blocks(wid):
            index.set_capacity(wid, index.capacity(wid) + matched - predicted)

    def _share_learnt(self, wid: str) -> None:
        """The first size learnt for a worker that does not report it is every such worker's
        until its own is: the modelled size of each worker of the same model still unknown
        becomes ``wid``'s (per unit of ring weight).

        Until its first miss a worker's cache is modelled as unbounded, so it looks empty to
        the placement of new prefixes (which places by cache fill and turnover); once one
        worker's size is learnt it alone looks full, and new prefixes went to the others,
        whose real caches were as full and evicted what the index still counted as held. A
        worker whose cache is really larger grows back by its own surprises (:meth:`_learn`)."""
        index, pool = self.index, self.pool
        learnt = pool.get(wid).worker
        per_weight = index.capacity(wid) / (learnt.weight or 1.0)
        for state in pool.states():
            other = state.worker
            if (other.id != wid and state.capacity_blocks <= 0 and not index.learnt(other.id)
                    and (other.models == learnt.models or other.models & learnt.models)):
                index.set_capacity(other.id, max(1, round(per_weight * other.weight)))
