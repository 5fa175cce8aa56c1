"""Picker: the best total score; ties go to the first worker in ring order from the anchor.

With no scorers every total is 0 and this is plain consistent hashing of the anchor (skipping
workers the filters removed). With scorers it keeps the decision deterministic across gateway
replicas: equal candidates resolve the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView

_EPS = 1e-9


class RingPicker:
    name = "ring"

    def pick(
        self, ctx: Context, candidates: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> tuple[WorkerView, str]:
        best = max(totals.values())
        by_id = {w.id: w for w in candidates if totals[w.id] >= best - _EPS}
        for skipped, wid in enumerate(ctx.snapshot.ring.walk(ctx.request.key.anchor)):
            chosen = by_id.get(wid)
            if chosen is not None:
                return chosen, "ring" if skipped == 0 else f"ring skip={skipped}"
        # A candidate the ring does not know yet (membership changed since it was built).
        chosen = by_id[min(by_id)]
        return chosen, "ring (not on ring)"
