"""Scorer: expected cost of each worker, the prefill it must do against the queue it has.

For a request of ``P`` prompt tokens whose first ``d`` of ``n`` blocks a worker is known to hold::

    prefill = P * (1 - d / n) * (1 + evict_weight * F)
    cost    = prefill_weight * prefill * (1 + Q_all / P)
              + wait_weight * ((Q - min Q) + P * (R - min R))
              + queue_weight * T

``F`` is the share of the worker's modelled cache in use (1 once full), ``Q`` its queued
prefill (prompt tokens of its requests in flight predicted not to be cached, until their first
token comes back), ``Q_all`` the candidates' total, ``R`` the requests its engine reports
waiting for admission and ``T`` its tokens in flight. The score is ``1 - cost / max cost``
over the candidates.

This is "spread when it beats waiting", in prefill tokens on both sides:

* a request sent away from the holder of its prefix must redo the prefill the holder would
  have skipped, and in a full cache that evicts as much that someone else will miss
  (``evict_weight = 1``: what LRU evicts is on average worth what it stores). A cache with
  room only defers that eviction, the less the fuller it is, so the charge grows with the
  fill: a cache nearly full is priced almost as a full one (priced as empty, a few blocks of
  room would pull a conversation off the full cache that holds half of it while the fleet
  warms up), and an empty cache, a worker just added, as free room;
* extra prefill is work every request queued in the pool waits for in turn, so on a busy pool
  it counts once per prompt of this size queued (``1 + Q_all / P``; 1 on an idle pool);
* waiting is only saved where a worker's queue is longer than the shortest candidate's (the
  queue every worker has is waited for wherever the request goes). The shortest, not the
  mean: a request that must prefill anyway (a new session off a shared system prompt, a
  prefix whose holder is overloaded) goes where the least prefill is queued, since on an
  engine whose prefills share its compute every token queued there slows it down (and on
  one that prefills in turn it waits for all of it). Measured against the mean, every
  worker below it looked equally idle and such prefills landed on workers busy with others:
  on agent sessions with shared prefill compute, p90 1.1-1.4x the Rust routers', against
  0.95-1.1x now (BENCHMARKS.md, "the volume guard off by default");
* an engine can queue without any prefill to do: when every running slot is taken (cached
  requests decoding), requests wait for admission, and the engine says how many
  (``num_requests_waiting``). Each one ahead is priced as one prefill of this prompt (a slot
  frees only when a request has been prefilled and decoded), against the candidate with the
  fewest waiting: a request sent there waits for none of the difference. The pool counts them
  only while the engine's recent admissions really waited (``gateway.pool.QUEUE_FLOOR_S``).

So a shared prompt stays on one holder while nobody queues (zero service time, tight caches:
copying it only evicts others), and moves to a second holder when its holder's queue outgrows
the work the move adds. There is no request-count threshold (``hot_threshold`` is off by
default). ``queue_weight`` (0.01) keeps a faint preference for less decode work in flight.

A cold prefix (no candidate holds at least the profile's ``min_match_blocks`` of it; the engine
drops shorter matches before any scorer sees them) scores 0 everywhere, so the picker falls back
to the anchor's ring position(s): gateway replicas agree on where it goes without talking.
``min_match_blocks = 2`` by default: a match of one block is what every prompt with a common
opening shares (on the Mooncake trace every request starts with the same block), so it says
nothing about where the rest of the prompt lives.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


def excess_wait(inflight_prefill: float, waiting: int, least_prefill: float,
                least_waiting: int, prompt: float) -> float:
    """What waiting on a worker costs beyond the other candidates, in prefill tokens: its
    queued prefill above the least-queued candidate's, and one prefill of the ``prompt`` per
    request its engine has waiting beyond the least-waiting candidate's."""
    return inflight_prefill - least_prefill + prompt * (waiting - least_waiting)


class CacheCostScorer:
    name = "cache_cost"

    def __init__(
        self,
        prefill_weight: float = 1.0,
        queue_weight: float = 0.01,
        wait_weight: float = 1.0,
        evict_weight: float = 1.0,
    ) -> None:
        if min(prefill_weight, queue_weight, wait_weight, evict_weight) < 0.0:
            raise ValueError("cache_cost weights must be >= 0")
        self.prefill_weight = prefill_weight
        self.queue_weight = queue_weight
        self.wait_weight = wait_weight
        self.evict_weight = evict_weight

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        blocks = ctx.request.key.total_blocks
        matches = ctx.matches
        if blocks == 0 or ctx.branch_anchor is not None or not matches:
            return {w.id: 0.0 for w in candidates}
        # One pass: whether a candidate holds any of it, the queued prefill (in all, the
        # least), the least waiting.
        held = False
        queued = 0
        least_queued = least_waiting = -1
        for w in candidates:
            if not held and matches.get(w.id, 0):
                held = True
            queued += w.inflight_prefill
            if least_queued < 0 or w.inflight_prefill < least_queued:
                least_queued = w.inflight_prefill
            if least_waiting < 0 or w.waiting_requests < least_waiting:
                least_waiting = w.waiting_requests
        if not held:
            return {w.id: 0.0 for w in candidates}
        prompt = max(ctx.request.prompt_tokens, 1)
        fill = ctx.snapshot.index.fill
        behind = 1.0 + queued / prompt
        costs: dict[str, float] = {}
        evict = self.evict_weight
        prefill_weight, wait_weight = self.prefill_weight, self.wait_weight
        queue_weight = self.queue_weight
        for w in candidates:
            wid = w.id
            prefill = prompt * (1.0 - matches.get(wid, 0) / blocks)
            if prefill > 0.0 and evict:
                prefill *= 1.0 + evict * fill(wid)  # what it evicts, now or soon
            # excess_wait(), inline: once per candidate and decision.
            costs[wid] = (prefill_weight * prefill * behind
                          + wait_weight * (w.inflight_prefill - least_queued
                                           + prompt * (w.waiting_requests - least_waiting))
                          + queue_weight * w.inflight_tokens)
        worst = max(costs.values())
        if worst <= 0.0:
            return {wid: 1.0 for wid in costs}
        return {wid: 1.0 - cost / worst for wid, cost in costs.items()}
