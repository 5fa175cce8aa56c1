"""Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), measured in tokens.

With ``L`` the in-flight tokens of all candidates and ``r`` the cost of this request, a worker of
weight share ``s`` (``weight / sum of weights``; 1/n when all are equal) may take the request
only while its in-flight tokens are at most ``c * s * (L + r)``: after taking it, it holds at
most ``c`` times its fair share plus this one request. The least-loaded worker always passes
(its load is at most its share), so the filter never empties the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


def load_bound(c: float, total_tokens: int, cost_tokens: int, share: float) -> float:
    return c * share * (total_tokens + cost_tokens)


class BoundedLoadFilter:
    name = "bounded_load"

    def __init__(self, c: float = 1.25) -> None:
        if c < 1.0:
            raise ValueError("the load bound factor c must be >= 1")
        self.c = c

    def apply(self, ctx: Context, candidates: Sequence[WorkerView]) -> list[WorkerView]:
        total = sum(w.inflight_tokens for w in candidates)
        weight_sum = sum(w.worker.weight for w in candidates) or 1.0
        cost = ctx.request.cost_tokens
        kept: list[WorkerView] = []
        for w in candidates:
            bound = load_bound(self.c, total, cost, w.worker.weight / weight_sum)
            ctx.load_bounds[w.id] = bound
            if w.inflight_tokens <= bound:
                kept.append(w)
        return kept
