"""A gateway whose start-up fails closes what it had opened: every resource has its own cleanup
context, so aiohttp leaves each one it entered (HTTP client pools, store, sync loops, ...)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.contracts.httpserver import JsonErrorRunner
from gateway.resources import STORE_KEY
from gateway.settings import GatewaySettings
from gateway.store.redis import RedisStore
from tests.conftest import FAST_WORKER, RedisServer, free_port, serve
from worker.server import create_app as create_worker

BACKGROUND = ("gateway-health", "gateway-rebalance", "kv-events-reconcile")


def open_client_sessions() -> set[int]:
    # Every live object is looked at; some libraries warn when merely inspected.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {id(o) for o in gc.get_objects()
                if isinstance(o, aiohttp.ClientSession) and not o.closed}


def gateway_tasks() -> list[str]:
    return sorted(
        t.get_name() for t in asyncio.all_tasks()
        if t.get_name().startswith(BACKGROUND) or t.get_name().startswith("sync-")
    )


async def test_a_store_that_cannot_start_closes_the_backends_opened_before_it() -> None:
    before = open_client_sessions()
    # A port out of range: the Redis client refuses the URL when the store starts.
    app = create_app(GatewaySettings(store=f"redis://127.0.0.1:{free_port() + 70_000}/0"))
    runner = JsonErrorRunner(app, access_log=None)
    with pytest.raises(ValueError, match="Port"):
        await runner.setup()
    assert open_client_sessions() - before, "the HTTP backends had opened their pools"
    await runner.cleanup()
    assert open_client_sessions() - before == set()
    assert gateway_tasks() == []


async def test_a_later_resource_failing_stops_the_loops_started_before_it(
    redis_server: RedisServer,
) -> None:
    wport = free_port()
    worker = await serve(create_worker(FAST_WORKER), wport)
    try:
        before = open_client_sessions()
        app = create_app(GatewaySettings(worker=(f"http://127.0.0.1:{wport}",),
                                         store=redis_server.url, health_interval_s=0.05))
        started: list[str] = []

        async def fails_to_start(app: web.Application) -> AsyncIterator[None]:
            started.extend(gateway_tasks())
            raise RuntimeError("cannot start")
            yield  # pragma: no cover

        # Right after the sync, before the KV-event feeds, the warm-up and the loops.
        contexts = list(app.cleanup_ctx)
        position = next(i for i, c in enumerate(contexts) if c.__name__ == "_sync") + 1
        app.cleanup_ctx.insert(position, fails_to_start)
        runner = JsonErrorRunner(app, access_log=None)
        with pytest.raises(RuntimeError, match="cannot start"):
            await runner.setup()
        assert any(name.startswith("sync-") for name in started)
        await runner.cleanup()
        assert gateway_tasks() == []
        assert open_client_sessions() - before == set()
        store = app[STORE_KEY]
        assert isinstance(store, RedisStore)
        with pytest.raises(Exception, match="not started"):
            await store.list_workers()
    finally:
        await worker.cleanup()
