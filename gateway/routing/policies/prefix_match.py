"""Scorer: the fraction of the request's prefix blocks a worker is known to hold."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


class PrefixMatchScorer:
    name = "prefix_match"

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        total = ctx.request.key.total_blocks
        if total == 0:
            return {w.id: 0.0 for w in candidates}
        return {w.id: ctx.matches.get(w.id, 0) / total for w in candidates}
