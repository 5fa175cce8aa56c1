"""Picker: candidates in turn, ignoring prefixes. The baseline affinity is measured against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self, ctx: Context, candidates: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> tuple[WorkerView, str]:
        ordered = sorted(candidates, key=lambda w: w.id)
        chosen = ordered[self._turn % len(ordered)]
        self._turn += 1
        return chosen, "round_robin"
