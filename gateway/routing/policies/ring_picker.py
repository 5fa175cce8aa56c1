"""Picker: the best total score; ties go to the first worker in ring order from the anchor.

With no scorers every total is 0 and this is plain consistent hashing of the anchor (skipping
workers the filters removed). With scorers it keeps the decision deterministic across gateway
replicas: equal candidates resolve the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView

_EPS = 1e-9


def _lightest(seen: tuple[int, WorkerView]) -> tuple[int, int]:
    """Fewest requests in flight, then fewest tokens: requests balance the routed counts, which
    tokens alone (a few long prompts) would skew."""
    view = seen[1]
    return view.inflight_requests, view.inflight_tokens


class RingPicker:
    """``choices = 1``: the first best candidate in ring order. ``choices = k > 1``: of the
    first ``k`` best candidates in ring order, the least loaded ("power of k choices" on the
    ring): a cold prefix still lands on one of a few fixed workers for its anchor, but the
    load spreads far more evenly than with the owner alone."""

    name = "ring"

    def __init__(self, choices: int = 1) -> None:
        if choices < 1:
            raise ValueError("choices must be >= 1")
        self.choices = choices

    def pick(
        self, ctx: Context, candidates: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> tuple[WorkerView, str]:
        best = max(totals.values())
        by_id = {w.id: w for w in candidates if totals[w.id] >= best - _EPS}
        seen: list[tuple[int, WorkerView]] = []
        walk = enumerate(ctx.snapshot.ring.walk(ctx.anchor))
        for skipped, wid in walk:
            view = by_id.get(wid)
            if view is None:
                continue
            seen.append((skipped, view))
            if len(seen) == min(self.choices, len(by_id)):
                break
        if seen:
            skipped, chosen = seen[0] if len(seen) == 1 else self.choose(ctx, seen)
            further = self.beyond(ctx, seen, walk, by_id)
            if further is not None:
                skipped, chosen = further
                return chosen, f"ring skip={skipped} past queued choices"
            return chosen, "ring" if skipped == 0 else f"ring skip={skipped}"
        # A candidate the ring does not know yet (membership changed since it was built).
        chosen = by_id[min(by_id)]
        return chosen, "ring (not on ring)"

    def choose(
        self, ctx: Context, seen: Sequence[tuple[int, WorkerView]]
    ) -> tuple[int, WorkerView]:
        """One of ``seen`` (ring position, view; two or more, in ring order): the lightest."""
        return min(seen, key=_lightest)

    def beyond(
        self, ctx: Context, seen: Sequence[tuple[int, WorkerView]],
        walk: Iterator[tuple[int, str]], by_id: Mapping[str, WorkerView],
    ) -> tuple[int, WorkerView] | None:
        """A worker further along the ring (``walk``, where it stopped past ``seen``; of the
        equals ``by_id``) to take instead of the one :meth:`choose` took; None: none."""
        return None
