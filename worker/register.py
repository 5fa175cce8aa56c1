"""Registration of a worker in the shared metadata store, with heartbeats.

A worker started with ``--store redis://...`` writes its record (public URL, model, cache
capacity, block size) and refreshes it every ``heartbeat_s``; the record expires
``registry_ttl_s`` after the last refresh, so a worker that dies (even by SIGKILL) leaves the
gateways' routing within a few seconds. On a clean stop it deregisters at once. If the store is
unreachable the worker keeps serving and keeps trying; it reappears as soon as the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.contracts.registry import RegistryClient, StoreUnavailable
from gateway.contracts.tasks import running, stop_if_cancelled
from gateway.contracts.worker_record import WorkerRecord

log = logging.getLogger(__name__)


async def heartbeat(
    registry: RegistryClient, record: WorkerRecord, every_s: float, ttl_s: float
) -> None:
    registered = False
    while True:
        try:
            await registry.register(record, ttl_s)
            if not registered:
                log.info("registered %s (%s) in %s", record.id, record.url, registry.url)
            registered = True
        except StoreUnavailable as exc:
            if registered:
                log.warning("store unreachable, still serving: %s", exc)
            registered = False
        stop_if_cancelled()
        await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def registered(
    store_url: str, record: WorkerRecord, *, every_s: float, ttl_s: float, prefix: str
) -> AsyncIterator[None]:
    """Keeps ``record`` registered (heartbeats) inside the block; deregisters on the way out.

    The one registration lifecycle of both the reference worker (as an aiohttp cleanup context,
    :func:`registration`) and the vLLM launcher (around the vLLM process)."""
    registry = RegistryClient(store_url, prefix=prefix)
    try:
        async with running(heartbeat(registry, record, every_s, ttl_s), "heartbeat"):
            yield
    finally:
        with contextlib.suppress(StoreUnavailable):
            await registry.deregister(record.id)
        await registry.close()


def registration(
    store_url: str, record: WorkerRecord, *, every_s: float, ttl_s: float, prefix: str
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context that keeps ``record`` registered while the app runs."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        async with registered(store_url, record, every_s=every_s, ttl_s=ttl_s, prefix=prefix):
            yield

    return ctx
