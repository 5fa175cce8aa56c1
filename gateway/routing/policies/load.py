"""Scorer: lighter workers score higher (1 for the idlest, 0 for the busiest), in tokens."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


class LoadScorer:
    name = "load"

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        busiest = max((w.inflight_tokens for w in candidates), default=0)
        if busiest == 0:
            return {w.id: 1.0 for w in candidates}
        return {w.id: 1.0 - w.inflight_tokens / busiest for w in candidates}
