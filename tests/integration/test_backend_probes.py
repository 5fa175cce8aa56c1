"""The OpenAI HTTP backend's health probe against real servers over 127.0.0.1: what it reads
and what each failure reads as (the probe's own client, not aiohttp's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.backends.base import UpstreamRequest
from gateway.backends.openai_http import OpenAIHTTPBackend
from gateway.contracts.httpserver import JsonErrorRunner
from gateway.routing.types import Worker
from tests.conftest import MODEL, Handler, free_port, probed_engine, serve

WARM_CONNECTIONS = 2
PAGE = ('# HELP vllm:num_requests_running Requests running.\n'
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n')


@pytest.fixture
async def backend() -> AsyncIterator[OpenAIHTTPBackend]:
    probes = OpenAIHTTPBackend(connect_timeout_s=1.0, read_timeout_s=5.0, max_connections=8,
                               max_connections_per_worker=2, probe_timeout_s=0.5,
                               warm_connections=WARM_CONNECTIONS,
                               default_api_key="sk-worker")
    await probes.start()
    yield probes
    await probes.close()


async def engine(routes: dict[tuple[str, str], Handler], health: Handler | None = None,
                 ) -> tuple[Worker, web.AppRunner]:
    """An engine that answers the probes, ``routes`` and (``GET /v1/models`` among them)
    its own listing."""
    port = free_port()
    listing = routes.get(("GET", "/v1/models"))
    if listing is None:
        app = probed_engine(routes, health)
    else:
        app = web.Application()
        app.router.add_get("/health", health or _healthy)
        for (method, path), handler in routes.items():
            app.router.add_route(method, path, handler)
    runner = await serve(app, port)
    return Worker(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"), runner


async def test_a_probe_reads_health_models_and_metrics(backend: OpenAIHTTPBackend) -> None:
    seen: list[tuple[str, str | None, str | None]] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization"),
                     request.headers.get("Content-Length")))
        return web.Response(text=PAGE)

    worker, runner = await engine({("GET", "/metrics"): metrics})
    try:
        for _ in range(3):
            probe = await backend.probe(worker)
            assert probe.healthy, probe.error
            assert probe.models == frozenset({MODEL})
            assert probe.metrics == {"vllm:num_requests_running": 3.0,
                                     "cache_capacity_tokens": 1600.0}
        # The worker's key on every probe, and no length for a GET without content.
        assert seen == [("/metrics", "Bearer sk-worker", None)] * 3
    finally:
        await runner.cleanup()


async def test_a_worker_without_metrics_is_healthy_without_them(
        backend: OpenAIHTTPBackend) -> None:
    worker, runner = await engine({})
    try:
        probe = await backend.probe(worker)
        assert probe.healthy
        assert probe.metrics == {}
    finally:
        await runner.cleanup()


async def _healthy(_: web.Request) -> web.Response:
    return web.json_response({})


async def _unhealthy(_: web.Request) -> web.Response:
    return web.json_response({"error": "loading"}, status=503)


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(2.0)
    return web.json_response({})


async def _not_json(_: web.Request) -> web.Response:
    return web.Response(text="<html>a proxy's page</html>")


@pytest.mark.parametrize(("health", "routes", "error", "timed_out"), [
    (_unhealthy, {}, "/health answered 503", False),
    (_slow, {}, "TimeoutError", True),
    (None, {("GET", "/v1/models"): _not_json}, "JSONDecodeError", False),
])
async def test_each_failure_reads_as_what_it_is(
        backend: OpenAIHTTPBackend, health: Handler | None,
        routes: dict[tuple[str, str], Handler], error: str, timed_out: bool) -> None:
    worker, runner = await engine(routes, health)
    try:
        probe = await backend.probe(worker)
        assert not probe.healthy
        assert error in probe.error
        assert probe.timed_out is timed_out
    finally:
        await runner.cleanup()


async def test_a_worker_that_is_not_there_is_unreachable(backend: OpenAIHTTPBackend) -> None:
    port = free_port()
    probe = await backend.probe(Worker(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"))
    assert not probe.healthy
    assert "BackendUnavailable" in probe.error


async def test_probe_connections_outlive_a_health_interval(backend: OpenAIHTTPBackend) -> None:
    # Probes of one worker come a health interval (5 s by default) apart: past the relay's
    # 4 s idle limit, but a probe reuses the connection the last one left; a server that
    # closed it meanwhile (its own keep-alive limit) gets a new one.
    ports: list[int] = []

    async def metrics(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(text=PAGE)

    port = free_port()
    runner = JsonErrorRunner(probed_engine({("GET", "/metrics"): metrics}), access_log=None,
                             idle_timeout_s=6.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    worker = Worker(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}")
    try:
        assert (await backend.probe(worker)).healthy
        await asyncio.sleep(4.5)
        assert (await backend.probe(worker)).healthy
        assert ports[0] == ports[1]  # the same connection, 4.5 s later
        await asyncio.sleep(6.5)  # the server closes it (its keep-alive limit is 6 s)
        probe = await backend.probe(worker)
        assert probe.healthy, probe.error
        assert ports[2] != ports[1]
    finally:
        await runner.cleanup()


async def test_a_healthy_probe_keeps_relay_connections_ready(backend: OpenAIHTTPBackend) -> None:
    # A request that finds no idle connection to its worker waits for a connect, several
    # passes of the event loop: a healthy probe opens the relay's connections ahead of it.
    ports: list[int] = []

    async def completions(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.json_response({"choices": []})

    worker, runner = await engine({("POST", "/v1/completions"): completions})
    server = runner.server
    assert server is not None
    try:
        assert (await backend.probe(worker)).healthy
        for _ in range(200):  # the probes' connection and the relay's two
            if len(server.connections) == 1 + WARM_CONNECTIONS:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # both handed to the relay's idle connections
        opened = {h.transport.get_extra_info("peername")[1]  # type: ignore[union-attr]
                  for h in server.connections}
        assert len(opened) == 1 + WARM_CONNECTIONS
        reply = await backend.send(worker, UpstreamRequest("/v1/completions",
                                                           {"model": MODEL, "prompt": "hi"}))
        assert reply.status == 200
        await reply.read()
        reply.release()
        assert ports[0] in opened  # written on a connection opened before it
        assert len(server.connections) == 1 + WARM_CONNECTIONS
    finally:
        await runner.cleanup()
