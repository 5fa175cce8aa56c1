"""Predictive pre-warming: place a hot prefix on its next holder before a request must wait.

The routing policy moves a prefix off its holder when waiting there costs more than the
prefill a move adds (``cache_cost``: the holder's queued prefill above the pool's mean and the
requests waiting in its engine beyond the least-waiting worker's, against the prompt tokens the
holder would have skipped, weighed by the prefill queued in the pool), and, with the
request-count rule on, spreads a hot prefix whose holder is over its load bound. Either way the
next request goes to another worker, which prefills the whole prefix on the critical path. The
pre-warmer watches the same quantities right after each decision: when the chosen worker held
the prefix, has at least ``min_holder_requests`` in flight, and either its excess wait has
reached ``fraction`` of what a move would add for a prefix asked for again (``repeat_heat``: a
conversation's previous turn is not, and its copy would only evict other prefixes) that is
not a trunk that sessions go on from (the index's record of the fork), or the
prefix is hot and the holder's load with this request has reached ``fraction`` of its bound,
the spread is imminent; it then replays the held prefix of this request as a prefill-only
request (``max_tokens`` 1, the same namespace, the body cut to the held prefix of its prompt by
:func:`gateway.prompt_cut.cut_body`; with token-exact keys a completions request of the held
prefix's token ids; the whole request where neither can be had) on the first worker of the
ring walk that does not hold the prefix, and records it there at once, as a routed request is
recorded at its decision. When the spread happens, the new holder answers from its cache.
The part past the held prefix (a RAG question, a session's own history) is not copied: only
this request would use it, and on the other worker it would take cache blocks from prefixes
that are used.

At most one pre-warm per prefix at a time and per ``cooldown_s``, and ``max_inflight`` in all;
the request body is used while the replay is in flight and then dropped (nothing is stored).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gateway.backends.base import UpstreamRequest
from gateway.contracts.engine_paths import COMPLETIONS_PATH
from gateway.fingerprint import PrefixKey
from gateway.pool import WorkerPool
from gateway.prompt_cut import cut_body
from gateway.routing.policies.cache_cost import excess_wait
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Decision, RouteRequest
from gateway.warmup_sources import WarmPrompt

# Called at the decision that chose the pre-warm (it may record it then); the awaitable it
# returns sends it (WarmupManager.prewarm).
Replay = Callable[[str, WarmPrompt, Coroutine[Any, Any, WarmPrompt] | None], Awaitable[bool]]
# A request's first N token ids as its engine runs them (None: not to be had); with token-exact
# keys (PromptTokenizer.leading_ids).
LeadingIds = Callable[[UpstreamRequest, int], Awaitable[list[int] | None]]

log = logging.getLogger(__name__)

_UNUSED_COPIES = 8  # session copies per worker remembered until a request uses them


@dataclass(frozen=True, slots=True)
class PrewarmOptions:
    enabled: bool = True
    hot_threshold: float = 8.0  # the routing policy's own threshold for a hot prefix
    fraction: float = 0.8  # of the holder's load bound at which the spread is imminent
    cooldown_s: float = 10.0
    max_inflight: int = 4
    # The holder must really be busy: with the bound's floor (one request's worth) a holder
    # serving a single request already sits at its bound, and an engine scrape can show a
    # request that has just finished; neither means the next request will be spread.
    min_holder_requests: int = 2
    wait_weight: float = 1.0  # the routing policy's weight of queued prefill (cache_cost)
    # The cost rule warms only a prefix asked for again: its heat (decayed request count, the
    # request that triggers it included) at least this.
    repeat_heat: float = 2.0
    # Characters per fingerprint block, to cut a copy to the held prefix.
    block_chars: int = 64
    # Copy the whole request, not only the held prefix (--prewarm-whole).
    whole: bool = False
    # The engine ``priority`` a session copy is sent with (0: none; --copy-priority).
    copy_priority: int = 0


def held_prefix(key: PrefixKey, match_blocks: int, block_chars: int) -> PrefixKey:
    """The part of a prompt's ``key`` a pre-warm copies: its checkpoints within the
    ``match_blocks`` blocks its holder has (the whole key where that is all of it). The
    simulator cuts its pre-warms with it too."""
    held = key.checkpoints_within(match_blocks)
    if held < 1 or held >= len(key.blocks):
        return key
    return key.cut(held, key.depth_at(held - 1) * block_chars)


class PreWarmer:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, replay: Replay,
                 options: PrewarmOptions, leading_ids: LeadingIds | None = None) -> None:
        self.pool = pool
        self.index = index
        self._replay = replay  # records one prefill-only request, then sends it (WarmupManager)
        self._leading_ids = leading_ids  # with token-exact keys: a request's first token ids
        self.options = options
        self.sent = 0  # pre-warms started
        self.placed = 0  # pre-warms that succeeded
        # Pre-warms a later request for their prefix was routed to (used, session copies
        # included), and the worker of each pre-warm not used yet, by anchor (the last one
        # per prefix).
        self.used = 0
        self.cut = 0  # pre-warms that copied only the held prefix (the rest: whole requests)
        self.sessions = 0  # of them, copies of a session the volume guard moves (copy_to)
        # Session copies over (answered or failed) and the seconds they took, summed, from
        # the decision that asked for each to its end: how long a copy keeps its worker
        # from taking another (WorkerView.copies).
        self.copies_done = 0
        self.copy_seconds = 0.0
        # Copies not asked for again while one of the same session was under way.
        self.copies_waited = 0
        # Session copies under way: (worker, key copied).
        self._copying: list[tuple[str, PrefixKey]] = []
        self._unused: dict[int, str] = {}
        # Session copies not used yet, by the worker they went to: the keys copied there.
        self._unused_copies: dict[str, list[PrefixKey]] = {}
        self._recent: dict[int, float] = {}  # anchor -> when its last pre-warm started
        self._tasks: set[asyncio.Future[bool]] = set()

    def after_route(self, decision: Decision, request: RouteRequest, upstream: UpstreamRequest,
                    tenant: str, now: float) -> str | None:
        """Called once per decision, at time ``now`` (no I/O here; the replay runs as a
        task). ``upstream`` is the request as it goes to the chosen worker. Returns the
        worker the prefix is pre-warmed on (None: none), which the answer names
        (``x-route-prewarm``) so that a replay of the run can place the same pre-warms."""
        target = self.target(decision, request, now, len(self._tasks))
        if target is None:
            return None
        session = target == decision.copy_to  # the volume guard's copy of a session: whole
        prompt = WarmPrompt(upstream.path, upstream.body, tenant, request.model, request.key,
                            namespace=upstream.namespace,
                            priority=self.options.copy_priority if session else 0,
                            session_copy=session)
        held = held_prefix(request.key, decision.match_blocks,
                           request.block_tokens or self.options.block_chars)
        later = None
        if held is not request.key and not self.options.whole and not session:
            if request.block_tokens and self._leading_ids is not None:
                later = self._held_ids(prompt, upstream, held)  # token-exact keys
                prompt = dataclasses.replace(prompt, key=held)
            elif not request.block_tokens:
                cut = cut_body(upstream.path, upstream.body, held.text_chars)
                if cut is not None:
                    prompt = dataclasses.replace(prompt, body=cut, key=held)
                    self.cut += 1
        # Recorded now, at the decision that chose it; sent by the task.
        task = asyncio.ensure_future(self._replay(target, prompt, later))
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        if session:
            started = time.monotonic()
            key = request.key
            task.add_done_callback(lambda _: self._copy_over(target, key, started))
        return target

    def _copy_over(self, target: str, key: PrefixKey, started: float) -> None:
        self.copies_done += 1
        self.copy_seconds += time.monotonic() - started
        self.copied(target, key)

    async def _held_ids(self, prompt: WarmPrompt, upstream: UpstreamRequest,
                        held: PrefixKey) -> WarmPrompt:
        """With token-exact keys the held prefix is ``held.text_chars`` tokens: the request
        that caches it is a completions request of those token ids (an engine caches a chat's
        blocks by its ids, whichever way they came), once they are encoded; the whole request
        where they cannot be had (content that is not text, a prompt the tokenizer refuses)."""
        assert self._leading_ids is not None
        ids = await self._leading_ids(upstream, held.text_chars)
        if ids is None:
            return prompt
        self.cut += 1
        body = {"model": upstream.body.get("model", prompt.model), "prompt": ids}
        return dataclasses.replace(prompt, path=COMPLETIONS_PATH, body=body, key=held)

    def target(self, decision: Decision, request: RouteRequest, now: float,
               inflight: int) -> str | None:
        """Where to pre-warm ``request``'s prefix after ``decision`` at time ``now``, with
        ``inflight`` pre-warms still under way (None: nowhere). Counts it as sent and starts
        its cooldown. Pure bookkeeping, no I/O: the simulator decides with it too.

        Every decision also tells whether it used a pre-warm: routed, with a prefix match, to
        the worker the last pre-warm of its prefix went to, or to a worker a session was
        copied to with a prompt that goes on from the copy (``used``).

        A decision that names a worker to copy its session to (``Decision.copy_to``: the
        volume guard keeps a session on its holder until a copy of it is made elsewhere) is
        pre-warmed there, its whole prompt, whether or not the pre-warm rule is on: that copy
        is how the session moves without a prefill on a request's path; the pool counts it in
        flight on its worker until :meth:`copied` (``WorkerView.copies``). At a background
        priority the index records it only when it answered
        (``WarmPrompt.recorded_at_answer``), so the session's next turn may still find no
        copy and ask again: while a copy of a prompt this request goes on from is under way,
        none is sent (``copies_waited``)."""
        self._count_use(decision, request)
        if decision.copy_to:
            if self._copy_under_way(request.key):
                self.copies_waited += 1
                return None
            self._copy_started(decision.copy_to, request.key)
            return decision.copy_to
        target = self._choose(decision, request, now, inflight)
        if target is not None:
            self._note(request, target, now)
        return target

    def replayed(self, decision: Decision, request: RouteRequest, now: float,
                 target: str) -> str | None:
        """:meth:`target` where the pre-warm at this decision is known: ``target``, the
        worker a live gateway pre-warmed at the same decision ("" for none), counted and
        remembered as :meth:`target` would, whatever the rule says now. The simulator
        replays a live run's pre-warms with it: whether the rule fires can turn on a request
        settling a moment sooner or later, which the simulator only approximates. At a
        decision that asks for a copy of its session (``copy_to``), the one placed is that
        copy, wherever the gateway sent it."""
        self._count_use(decision, request)
        if not target:
            return None
        if decision.copy_to:  # the copy of a session this decision asks for, where it went
            self._copy_started(target, request.key)
        else:
            self._note(request, target, now)
        return target

    def _copy_under_way(self, key: PrefixKey) -> bool:
        """Whether a session copy of a prompt that ``key`` goes on from is under way."""
        return any(key.goes_on_from(copied) for _, copied in self._copying)

    def _copy_started(self, target: str, key: PrefixKey) -> None:
        self.pool.copying(target, 1)
        self._copying.append((target, key))
        self.sessions += 1
        self.sent += 1
        copies = self._unused_copies.setdefault(target, [])
        copies.append(key)
        if len(copies) > _UNUSED_COPIES:  # bounded: the oldest is taken as never used
            del copies[0]

    def copied(self, target: str, key: PrefixKey) -> None:
        """A session's copy of ``key`` to ``target`` is over (answered or failed): the
        worker can take another, and the session may be copied again. The simulator calls it
        when its copy is done."""
        self.pool.copying(target, -1)
        for i, (wid, copied) in enumerate(self._copying):
            if wid == target and copied is key:
                del self._copying[i]
                break

    def _count_use(self, decision: Decision, request: RouteRequest) -> None:
        if decision.match_blocks <= 0:
            return
        anchor = request.key.anchor
        if self._unused.get(anchor) == decision.worker_id:
            del self._unused[anchor]
            self.used += 1
        elif copies := self._unused_copies.get(decision.worker_id):
            for i, copied in enumerate(copies):
                if request.key.goes_on_from(copied):
                    del copies[i]
                    self.used += 1
                    break

    def _choose(self, decision: Decision, request: RouteRequest, now: float,
                inflight: int) -> str | None:
        """The pre-warm rule (module docstring): the worker to pre-warm on, or None."""
        opts = self.options
        depth = decision.match_blocks  # in blocks
        anchor = request.key.anchor
        if not opts.enabled or depth < 1 or inflight >= opts.max_inflight:
            return None
        key = request.key
        held = key.checkpoints_within(depth)
        if held < 1 or decision.worker.inflight_requests < opts.min_holder_requests:
            return None
        block = key.blocks[held - 1]
        if not (self._waiting_outgrows_prefill(decision, request, block, now)
                or self._hot_near_bound(decision, request, block, now)):
            return None
        if now - self._recent.get(anchor, -opts.cooldown_s) < opts.cooldown_s:
            return None
        return self._next_holder(request, held, now)

    def _note(self, request: RouteRequest, target: str, now: float) -> None:
        """A pre-warm of ``request``'s prefix on ``target`` starts at ``now``: its cooldown,
        the worker it went to (for ``used``), the count of those sent."""
        anchor = request.key.anchor
        self._recent[anchor] = now
        if len(self._recent) > 4096:  # bounded: forget the oldest half
            for old in sorted(self._recent, key=self._recent.__getitem__)[:2048]:
                del self._recent[old]
        self._unused.pop(anchor, None)
        self._unused[anchor] = target  # in the order they were sent
        if len(self._unused) > 4096:  # bounded: the oldest half is taken as never used
            for old in list(itertools.islice(self._unused, 2048)):
                del self._unused[old]
        self.sent += 1

    def _waiting_outgrows_prefill(self, decision: Decision, request: RouteRequest, block: int,
                                  now: float) -> bool:
        """The cost rule's spread is near for a prefix asked for again: the holder's wait (its
        queued prefill above the least-queued worker's, and one prefill of this prompt per
        request its engine has waiting beyond the least-waiting worker's) has reached
        ``fraction`` of the prefill a move would add (in the policy's terms), and the held
        prefix (``block``) is a repeat, its heat (this request included) at least
        ``repeat_heat``.

        The spread this anticipates is a later request for the same prefix while the holder
        is still busy. A prefix asked for once (a conversation's previous turn, whose next
        turn comes long after the queue drained) is not spread, and its copy only evicts
        other prefixes from the target's cache: on the Mooncake trace 84-87 % of such
        copies were never used.

        The copy is the held prefix (``after_route``). Where that prefix is a fork whose
        branches are sessions (the index's record of it: later prompts extended them at
        least as often as they shared them from inside), a later request for it is mostly a
        session's next turn, which goes to its own holder, not to the copy; only a new
        session would use the copy, and without it that session prefills the same trunk
        once, so the copy buys nothing and takes the other worker's compute while it serves.
        Such prefixes are not warmed by this rule. (On multi-turn chat with prefills sharing
        the engine's compute, warming them sent 6-7 copies of a system prompt per 1,000
        requests, for 0.4 points of hit rate lost and p99 98 against 76 ms.) A RAG document
        past the same kind of trunk is shared by the questions on it, and is warmed."""
        if self.index.heat(block, now) < self.options.repeat_heat:
            return False
        key = request.key
        if (key.checkpoints_within(decision.match_blocks) < len(key.blocks)
                and self.index.branches_grow(block, unseen=False)):
            return False  # a session going on from a trunk of sessions
        blocks = key.total_blocks
        if not blocks:
            return False
        prompt = max(request.prompt_tokens, 1)
        # One pass over the healthy workers: the holder, the queued prefill, the least waiting.
        holder_id = decision.worker.id
        holder = None
        queued = holder_waiting = 0
        least_queued = least_waiting = -1
        for s in self.pool.states():
            if not s.healthy:
                continue
            queued += s.inflight_prefill
            if least_queued < 0 or s.inflight_prefill < least_queued:
                least_queued = s.inflight_prefill
            waiting = s.waiting_requests()
            if least_waiting < 0 or waiting < least_waiting:
                least_waiting = waiting
            if s.worker.id == holder_id:
                holder, holder_waiting = s, waiting
        if holder is None:
            return False
        saved = prompt * min(decision.match_blocks, blocks) / blocks
        behind = 1.0 + queued / prompt
        excess = self.options.wait_weight * excess_wait(
            holder.inflight_prefill, holder_waiting, least_queued, least_waiting, prompt)
        return saved > 0 and excess >= self.options.fraction * saved * behind

    def _hot_near_bound(
        self, decision: Decision, request: RouteRequest, block: int, now: float
    ) -> bool:
        """The request-count rule's spread is near: a hot prefix, its holder near its bound."""
        opts = self.options
        if decision.load_bound is None or self.index.heat(block, now) < opts.hot_threshold:
            return False
        load = decision.worker.inflight_tokens + request.cost_tokens
        return load >= opts.fraction * (decision.load_bound + request.cost_tokens)

    def _next_holder(self, request: RouteRequest, held: int, now: float) -> str | None:
        matches = self.index.match(request.key.blocks, now)
        holders = {w for w, count in matches.items() if count >= held}
        for wid in self.pool.ring.walk(request.key.anchor):
            if wid in holders or wid not in self.pool:
                continue
            state = self.pool.get(wid)
            if state.healthy and not state.held_out:
                return wid
        return None

    def _settled(self, task: asyncio.Future[bool]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            log.warning("a pre-warm failed: %r", exc)
        elif task.result():
            self.placed += 1

    def stats(self) -> dict[str, int | bool | float]:
        """Counts since start, for ``/admin/workers``: pre-warms started, placed (the worker
        answered), failed, still in flight, and used (a later request for the prefix was
        routed to the pre-warmed worker, or a session's next turn to its copy: the copy paid
        off, as far as the index knows), cut
        (copies of the held prefix alone; the others copied the whole request), sessions
        (copies of a session the volume guard moves), and of those, copies_done (answered or
        failed) and copy_seconds (what they took, summed: from the decision that asked for
        each to its end, the time its worker takes no other copy), and copies_waited (not
        sent again while one of the same session was under way)."""
        inflight = len(self._tasks)
        return {"enabled": self.options.enabled, "sent": self.sent, "placed": self.placed,
                "failed": self.sent - self.placed - inflight, "inflight": inflight,
                "used": self.used, "cut": self.cut, "sessions": self.sessions,
                "copies_done": self.copies_done, "copy_seconds": round(self.copy_seconds, 6),
                "copies_waited": self.copies_waited}

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
