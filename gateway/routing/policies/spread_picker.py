"""Picker: of the first ``k`` best candidates on the ring, the one a new prefix costs least.

``cache_aware`` sends a cold prefix (one no worker is known to hold) to one of the first ``k``
workers on the ring from its anchor. Which one decides two things at once, and the in-flight
count alone gets neither right on real traffic:

* **the request balance**: conversations stick to the worker that holds them, so a worker's
  future load is the traffic it was *given recently*, not only what is in flight this instant;
* **the hit rate**: a worker whose least recently used block is young evicts, for the blocks
  this prompt adds, prefixes that were used moments ago. Placing new prefixes where the oldest
  block is oldest makes the fleet's caches evict as one shared LRU would, which is the pooled
  bound the hit rate is measured against.

Request sizes differ by 10x and more (a 250-block document next to a 5-block question), so
balancing requests alone skews the cache pressure, and balancing blocks alone skews the
request counts. The picker minimises one two-term load, each term relative to the mean over
the choices::

    key(w) = recent_requests(w) / mean  +  pressure_weight * (n_w / n_mean) * pressure(w) / mean

``recent_requests`` is the decayed count of requests the index recorded for ``w`` (its own
gateway's and, through the metadata store, the other replicas'); ``pressure = 1 / tail_age``
is how fast ``w``'s modelled cache turns over (0 while it has room); ``n_w`` is the blocks this
request would add to ``w`` and ``n_mean`` what a request adds on average. While no choice's
cache is full (a fleet warming up), the pressure is each one's fill, the share of its modelled
cache in use: the fullest is the first that will evict, and placing long prompts by fill makes
the caches fill evenly, so that they start evicting together and at the same pace. Balancing
request counts alone there let the caches that happened to take the long prompts fill first
and evict from then on faster than the rest. The size factor is
what makes one key serve both goals: a short prompt goes where requests are fewest, a long one
where eviction is cheapest (the greedy step for the sum of squares of both loads).

A choice with more than ``guard`` times the mean requests in flight of the choices is skipped
first, so a worker with an old cache tail is not handed new prefixes while its queue grows.
Requests (recent and in flight) count per unit of ring weight, which follows cache capacity:
a worker with twice the cache takes twice the requests.
Ties (an index that has recorded nothing yet) go to fewer requests in flight, then fewer tokens
in flight, then ring order, so replicas that see the same index and loads agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from gateway.routing.engine import Context
from gateway.routing.policies.bounded_load import starts_at_once
from gateway.routing.policies.cache_cost import excess_wait
from gateway.routing.policies.ring_picker import RingPicker
from gateway.routing.types import WorkerView


class SpreadPicker(RingPicker):
    name = "spread"

    def __init__(self, choices: int = 4, guard: float = 1.5, pressure_weight: float = 4.0,
                 past_queued: bool = True, quick_s: float = 0.0) -> None:
        super().__init__(choices)
        if guard < 1.0:
            raise ValueError("guard must be >= 1")
        if pressure_weight < 0.0:
            raise ValueError("pressure_weight must be >= 0")
        self.guard = guard
        self.pressure_weight = pressure_weight
        self.past_queued = past_queued
        self.quick_s = quick_s  # an engine this quick to a first token makes nobody wait

    def beyond(
        self, ctx: Context, seen: Sequence[tuple[int, WorkerView]],
        walk: Iterator[tuple[int, str]], by_id: Mapping[str, WorkerView],
    ) -> tuple[int, WorkerView] | None:
        """With ``past_queued``, for a new session off a shared trunk (a branch, placed from
        the ring past the trunk), when every choice would make the prompt wait (a prefill
        queued there, or requests its engine has waiting for admission, unless its engine
        reports first tokens within ``quick_s``, as the load bound's exemption reads them:
        there nothing waits however much is queued), the first worker
        further along the ring with no wait, if the prefill it adds (the part of the prompt
        the choices hold that it does not: the shared trunk of a new session) is less than
        the least wait among the choices (of as many such as there were choices, the one
        :meth:`choose` takes); None otherwise.

        The choices keep cold placement tied to the anchor and the caches' turnover even,
        which no request waits for; a prompt sent where a prefill is under way waits for it
        (or, on an engine whose prefills share compute, both slow down). With most workers
        busy, all of a few choices often are while others idle: agents' new sessions doubled
        up on one worker that way, their first turns (thousands of tokens each) setting the
        p99. Only a branch: what it places is one session's own context, which its next
        turns follow wherever it is. A cold prefix may be a document many later requests
        share, whose place the choices' balance matters more for than its first request's
        wait: walked past its choices, the new documents of a RAG workload's opening went to
        the one idle worker in turn, and its p99 rose 9-16% (BENCHMARKS.md)."""
        if not self.past_queued or ctx.branch_anchor is None:
            return None
        prompt = max(ctx.request.prompt_tokens, 1)
        quick = self.quick_s
        least = min(_wait(view, prompt, quick) for _, view in seen)
        if least <= 0 or len(by_id) <= len(seen) or all(
                _wait(view, prompt, quick) for view in by_id.values()):
            return None  # a choice makes it wait for nothing, or every worker would
        matches = ctx.matches
        held = max(matches.get(view.id, 0) for _, view in seen)
        blocks = max(ctx.request.key.total_blocks, 1)
        free: list[tuple[int, WorkerView]] = []
        for skipped, wid in walk:
            view = by_id.get(wid)
            if view is None or _wait(view, prompt, quick) > 0:
                continue
            if prompt * (held - matches.get(wid, 0)) / blocks < least:
                free.append((skipped, view))
                if len(free) == len(seen):
                    break
        if not free:
            return None
        return free[0] if len(free) == 1 else self.choose(ctx, free)

    def choose(
        self, ctx: Context, seen: Sequence[tuple[int, WorkerView]]
    ) -> tuple[int, WorkerView]:
        # Requests count per unit of weight: a worker of twice the capacity (ring weight) takes
        # twice the requests. Its cache turns over more slowly by itself. (Loops, not
        # comprehensions: this runs for every cold prefix, over two to four choices.)
        weight: dict[str, float] = {}
        busy: dict[str, float] = {}
        for _, v in seen:
            w = weight[v.id] = max(v.worker.weight, 1e-9)
            busy[v.id] = v.inflight_requests / w
        limit = self.guard * sum(busy.values()) / len(seen)
        eligible = [sv for sv in seen if busy[sv[1].id] <= limit] or list(seen)
        index = ctx.snapshot.index
        recent: dict[str, float] = {}
        pressure: dict[str, float] = {}
        evicting = False
        for _, v in eligible:
            recent[v.id] = index.recent_requests(v.id) / weight[v.id]
            p = pressure[v.id] = _pressure(index.tail_age(v.id))
            evicting = evicting or bool(p)
        if not evicting:  # nobody evicts yet: the fullest will be first
            for _, v in eligible:
                pressure[v.id] = index.fill(v.id)
        mean_recent = sum(recent.values()) / len(eligible) or 1.0
        mean_pressure = sum(pressure.values()) / len(eligible) or 1.0
        blocks = ctx.request.key.total_blocks
        mean_new = index.mean_new_blocks() or float(max(blocks, 1))
        matches = ctx.matches
        weighted = self.pressure_weight
        # The least (load, requests in flight per weight, tokens in flight, ring position):
        # the first of equals, as min() would take.
        best: tuple[float, float, int, int] | None = None
        chosen = eligible[0]
        for sv in eligible:
            skipped, view = sv
            size = (blocks - matches.get(view.id, 0)) / mean_new
            load = (recent[view.id] / mean_recent
                    + weighted * size * pressure[view.id] / mean_pressure)
            cost = (load, busy[view.id], view.inflight_tokens, skipped)
            if best is None or cost < best:
                best, chosen = cost, sv
        return chosen


def _wait(view: WorkerView, prompt: int, quick_s: float) -> float:
    """What a prompt of ``prompt`` tokens waits for on ``view``, in prefill tokens, as
    ``cache_cost`` prices it against an idle worker; nothing where its engine starts
    requests at once (as the load bound exempts it)."""
    if starts_at_once(view, quick_s):
        return 0
    return excess_wait(view.inflight_prefill, view.waiting_requests, 0, 0, prompt)


def _pressure(tail_age: float) -> float:
    """How fast a modelled cache turns over: 1 / age of its oldest block (0 with room left)."""
    if math.isinf(tail_age):
        return 0.0
    return 1.0 / max(tail_age, 1e-3)
