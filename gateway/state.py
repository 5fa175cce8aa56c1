"""Everything one gateway application owns, built once at startup."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends.base import Backend
from gateway.guard import UpstreamGuard
from gateway.kvevents.source import ExactSource
from gateway.lifecycle import CacheLifecycle
from gateway.pool import WorkerPool
from gateway.prewarm import PreWarmer
from gateway.rebalance import Rebalancer
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Worker
from gateway.session import RoutingSession
from gateway.settings import GatewaySettings
from gateway.store.base import MetadataStore
from gateway.sync import StoreSync
from gateway.telemetry import GatewayMetrics
from gateway.warmup import WarmupManager


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    pool: WorkerPool
    index: PrefixIndex
    session: RoutingSession  # routes and accounts every attempt (owns index writes per request)
    backends: dict[str, Backend]
    metrics: GatewayMetrics
    store: MetadataStore
    sync: StoreSync
    rebalancer: Rebalancer
    exact: ExactSource  # engine-exact cache knowledge: KV-event feeds, tokenizer
    guard: UpstreamGuard
    warmup: WarmupManager
    lifecycle: CacheLifecycle
    prewarmer: PreWarmer

    def backend_for(self, worker: Worker) -> Backend:
        backend = self.backends.get(worker.kind)
        if backend is None:
            raise LookupError(f"no backend for worker kind {worker.kind!r}")
        return backend
