"""Everything one gateway application owns, built once at startup."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends.base import Backend
from gateway.pool import WorkerPool
from gateway.routing.engine import RoutingEngine
from gateway.routing.prefix_index import PrefixIndex
from gateway.settings import GatewaySettings
from gateway.telemetry import GatewayMetrics


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    pool: WorkerPool
    index: PrefixIndex
    engine: RoutingEngine
    backend: Backend
    metrics: GatewayMetrics
