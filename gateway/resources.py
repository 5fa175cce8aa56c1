"""What the gateway opens at start-up and closes at shutdown: one ``AppKey`` and one aiohttp
cleanup context per resource.

:func:`install` appends the contexts in dependency order: tracing, the event loop's lag probe
(:mod:`gateway.telemetry.loop_lag`), one HTTP client pool per backend, the metadata store, the
store sync, pod discovery, the first health round, the KV-event feeds, the warm-up, the cache
lifecycle and pre-warming (their on-demand tasks), the rebalancer and the health loop. aiohttp
enters them in that order and leaves them in reverse, and leaves every context it entered even
when a later one fails to start, so a failed start-up closes what it had opened.

Request handlers do not look these keys up: they read the one ``GatewayState`` the app holds
(``gateway.api.STATE``), which refers to the resources they need.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.backends.base import Backend
from gateway.contracts.tasks import running
from gateway.discovery import PodDiscovery
from gateway.health import HealthChecker
from gateway.kvevents.source import ExactSource
from gateway.lifecycle import CacheLifecycle
from gateway.pool import WorkerPool
from gateway.prewarm import PreWarmer
from gateway.rebalance import Rebalancer
from gateway.store.base import MetadataStore
from gateway.sync import StoreSync
from gateway.telemetry.loop_lag import LoopLag
from gateway.telemetry.middleware import TELEMETRY_KEY
from gateway.warmup import WarmupManager

CleanupContext = Callable[[web.Application], AsyncIterator[None]]

BACKENDS_KEY = web.AppKey[dict[str, Backend]]("backends")
STORE_KEY = web.AppKey("store", MetadataStore)
SYNC_KEY = web.AppKey("sync", StoreSync)
HEALTH_KEY = web.AppKey("health", HealthChecker)
EXACT_KEY = web.AppKey("exact", ExactSource)
POOL_KEY = web.AppKey("pool", WorkerPool)
WARMUP_KEY = web.AppKey("warmup", WarmupManager)
LIFECYCLE_KEY = web.AppKey("lifecycle", CacheLifecycle)
PREWARMER_KEY = web.AppKey("prewarmer", PreWarmer)
REBALANCER_KEY = web.AppKey("rebalancer", Rebalancer)
DISCOVERY_KEY = web.AppKey[PodDiscovery | None]("discovery")
FIRST_LIST_S = 10.0  # the longest start-up waits for pod discovery's first list


async def _tracing(app: web.Application) -> AsyncIterator[None]:
    """Spans recorded until shutdown are flushed at the very end."""
    try:
        yield
    finally:
        await app[TELEMETRY_KEY].tracing.shutdown()


def _backend(kind: str) -> CleanupContext:
    """The HTTP client pool (or SDK session) of one backend kind."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        backend = app[BACKENDS_KEY][kind]
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    return ctx


async def _store(app: web.Application) -> AsyncIterator[None]:
    store = app[STORE_KEY]
    await store.start()
    try:
        yield
    finally:
        await store.close()


async def _sync(app: web.Application) -> AsyncIterator[None]:
    sync = app[SYNC_KEY]
    await sync.start()
    try:
        yield
    finally:
        await sync.stop()


async def _discovery(app: web.Application) -> AsyncIterator[None]:
    """Pod discovery lists the pods once before the first health round (waiting at most
    ``FIRST_LIST_S``, and not past a failed first try: the gateway serves what else it has
    while discovery retries), then watches them until shutdown."""
    discovery = app[DISCOVERY_KEY]
    if discovery is None:
        yield
        return
    async with running(discovery.run(), "gateway-discovery"):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(discovery.first_try.wait(), FIRST_LIST_S)
        yield


async def _first_health_round(app: web.Application) -> AsyncIterator[None]:
    """Workers are probed once before the first request, and the ring is built from them then,
    not in the first request's decision; later changes rebuild it between requests
    (``WorkerPool.defer``) until shutdown."""
    await app[HEALTH_KEY].probe_all()
    pool = app[POOL_KEY]
    pool.defer = asyncio.get_running_loop().call_soon
    pool.prepare_ring()
    try:
        yield
    finally:
        pool.defer = None


async def _kv_events(app: web.Application) -> AsyncIterator[None]:
    exact = app[EXACT_KEY]
    await exact.start(app[POOL_KEY])
    try:
        yield
    finally:
        await exact.close()


async def _warmup(app: web.Application) -> AsyncIterator[None]:
    warmup = app[WARMUP_KEY]
    warmup.start()
    try:
        yield
    finally:
        await warmup.stop()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Cache invalidations run as tasks the health loop starts; stopped at shutdown."""
    try:
        yield
    finally:
        await app[LIFECYCLE_KEY].stop()


async def _prewarmer(app: web.Application) -> AsyncIterator[None]:
    """Pre-warm replays run as tasks requests start; stopped at shutdown."""
    try:
        yield
    finally:
        await app[PREWARMER_KEY].stop()


async def _loop_lag(app: web.Application) -> AsyncIterator[None]:
    """The event loop's lag is sampled from start-up to shutdown (``/metrics``)."""
    lag = LoopLag(app[TELEMETRY_KEY].metrics.loop_lag.observe)
    lag.start()
    try:
        yield
    finally:
        lag.stop()


def _task(name: str, run: Callable[[web.Application], Coroutine[Any, Any, None]]
          ) -> CleanupContext:
    """A background loop, cancelled (and awaited) at shutdown."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        async with running(run(app), name):
            yield

    return ctx


def install(app: web.Application) -> None:
    """Append the cleanup context of every resource, in the order they depend on each other
    (every key above must be set)."""
    app.cleanup_ctx.append(_tracing)
    app.cleanup_ctx.append(_loop_lag)
    for kind in app[BACKENDS_KEY]:
        app.cleanup_ctx.append(_backend(kind))
    app.cleanup_ctx.extend([
        _store,
        _sync,
        _discovery,
        _first_health_round,
        _kv_events,
        _warmup,
        _lifecycle,
        _prewarmer,
        _task("gateway-rebalance", lambda a: a[REBALANCER_KEY].run()),
        _task("gateway-health", lambda a: a[HEALTH_KEY].run()),
    ])
