"""Scorer: expected work on each worker, prefill it cannot skip plus the queue it already has.

For a request of ``P`` prompt tokens whose first ``d`` of ``n`` fingerprint blocks a worker is
known to hold, and ``Q`` tokens already in flight on that worker::

    cost = prefill_weight * P * (1 - d / n) + queue_weight * Q

The score is ``1 - cost / max cost`` over the candidates, so the cheapest worker scores highest
and the scale of the numbers does not matter. One continuous trade-off instead of an on/off
switch: a deep match wins until the holder's queue costs more than the prefill it saves.

A cold prefix (no candidate holds any of it) scores 0 everywhere, so the picker falls back to
the anchor's ring position: every gateway replica places it on the same worker without talking,
and siblings of a burst meet there instead of each warming a different worker.

Weights: ``prefill_weight = 1`` and ``queue_weight = 0.5`` by default. A queued token costs the
worker roughly as much time as a prefill token while it is being prefilled, and less while it is
being decoded (decode is memory-bound and batched), so a half weight sits between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


class CacheCostScorer:
    name = "cache_cost"

    def __init__(self, prefill_weight: float = 1.0, queue_weight: float = 0.5) -> None:
        self.prefill_weight = prefill_weight
        self.queue_weight = queue_weight

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        blocks = len(ctx.request.key.blocks)
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
