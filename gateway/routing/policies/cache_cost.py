"""Scorer: expected work on each worker, prefill it cannot skip plus the queue it already has.

For a request of ``P`` prompt tokens whose first ``d`` of ``n`` fingerprint blocks a worker is
known to hold, and ``Q`` tokens already in flight on that worker::

    cost = prefill_weight * P * (1 - d / n) + queue_weight * Q

The score is ``1 - cost / max cost`` over the candidates, so the cheapest worker scores highest
and the scale of the numbers does not matter. One continuous trade-off instead of an on/off
switch: a deep match wins until the holder's queue costs more than the prefill it saves.

A cold prefix (no candidate holds at least the profile's ``min_match_blocks`` of it; the engine
drops shorter matches before any scorer sees them) scores 0 everywhere, so
the picker falls back to the anchor's ring position(s): gateway replicas agree on where it goes
without talking, and siblings of a burst meet there instead of each warming a different worker.
``min_match_blocks = 2`` by default: a match of one block is what every prompt with a common
opening shares (on the Mooncake trace every request starts with the same block), so it says
nothing about where the rest of the prompt lives.

Weights: ``prefill_weight = 1``, ``queue_weight = 0.01`` by default. In-flight tokens are mostly
decode and running work, which a worker batches: a token in flight elsewhere delays this
request's prefill far less than a token it must prefill itself. Measured on the Mooncake trace
(BENCHMARKS.md, "Issue 6"): 0.5 gave away a quarter of the reachable hits for no better
balance; 0 keeps every hit but lets a holder's queue grow; 0.01 keeps 0.99 of the pooled bound
with cumulative load within 1.1 x mean.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


class CacheCostScorer:
    name = "cache_cost"

    def __init__(self, prefill_weight: float = 1.0, queue_weight: float = 0.01) -> None:
        self.prefill_weight = prefill_weight
        self.queue_weight = queue_weight

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        blocks = ctx.request.key.total_blocks
        if blocks == 0 or not any(ctx.matches.get(w.id, 0) for w in candidates):
            return {w.id: 0.0 for w in candidates}
        prompt = max(ctx.request.prompt_tokens, 1)
        costs = {
            w.id: self.prefill_weight * prompt * (1.0 - ctx.matches.get(w.id, 0) / blocks)
            + self.queue_weight * w.inflight_tokens
            for w in candidates
        }
        worst = max(costs.values())
        if worst <= 0.0:
            return {wid: 1.0 for wid in costs}
        return {wid: 1.0 - cost / worst for wid, cost in costs.items()}
