"""Filters every policy starts with: the worker is healthy and serves the requested model."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


class HealthyFilter:
    name = "healthy"

    def apply(self, ctx: Context, candidates: Sequence[WorkerView]) -> list[WorkerView]:
        return [w for w in candidates if w.healthy]


class ModelFilter:
    name = "model"

    def apply(self, ctx: Context, candidates: Sequence[WorkerView]) -> list[WorkerView]:
        model = ctx.request.model
        # Worker.serves, inline: once per candidate and decision.
        return [w for w in candidates if not w.worker.models or model in w.worker.models]
