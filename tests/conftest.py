"""Shared fixtures: real servers on 127.0.0.1 in the test's event loop.

``Cluster`` starts reference workers (the simulated engine, with real cache bookkeeping) and a
gateway in front of them, each on its own free port with real sockets and real HTTP between
them. Nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from gateway.api import STATE
from gateway.app import create_app as create_gateway
from gateway.contracts.httpserver import JsonErrorRunner
from gateway.health import HealthChecker
from gateway.pool import WorkerPool
from gateway.resources import HEALTH_KEY
from gateway.settings import GatewaySettings
from infra.procs import PortLedger, stop_processes, wait_healthy
from tests.browser import CHROMIUM, DRIVER
from worker.server import create_app as create_worker
from worker.settings import WorkerSettings

MODEL = "sim-model"

# Fast simulated costs: requests still take tens of milliseconds, so concurrent ones overlap.
FAST_WORKER = WorkerSettings(
    model=MODEL,
    prefill_us_per_token=20.0,
    prefill_us_per_cached_token=1.0,
    decode_ms_per_token=2.0,
)


# The test run's one port ledger (the suite runs in one process): every server a test starts
# gets a port no other server of the run was given, from under the kernel's ephemeral range.
PORTS = PortLedger()


def free_port() -> int:
    """A loopback port free now that no other test server of this run was given."""
    return PORTS.take()


def free_ports(size: int) -> int:
    """The first of ``size`` consecutive such ports."""
    return PORTS.take(size)


async def serve(app: web.Application, port: int) -> web.AppRunner:
    runner = JsonErrorRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner



Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def probed_engine(routes: dict[tuple[str, str], Handler] | None = None,
                  health: Handler | None = None) -> web.Application:
    """An engine that answers the gateway's health and model probes (``health``: its own
    ``/health`` handler), and ``routes`` ((method, path) to handler)."""

    async def healthy(_: web.Request) -> web.Response:
        return web.json_response({})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health or healthy)
    app.router.add_get("/v1/models", models)
    for (method, path), handler in (routes or {}).items():
        app.router.add_route(method, path, handler)
    return app


@contextlib.asynccontextmanager
async def probed_by_hand(*workers: str) -> AsyncIterator[tuple[WorkerPool, HealthChecker]]:
    """A gateway over ``workers`` whose probe rounds the test drives (the background rounds
    wait an hour): its pool and its health checker, after the start-up round."""
    port = free_port()
    app = create_gateway(GatewaySettings(port=port, worker=workers, health_interval_s=3600.0))
    runner = await serve(app, port)
    try:
        yield app[STATE].pool, app[HEALTH_KEY]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def stopped(*procs: asyncio.subprocess.Process) -> AsyncIterator[None]:
    """The processes stopped (SIGSTOP: the kernel still accepts their connections, nothing
    answers) until the block ends."""
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def gateway_over(workers: list[str], **overrides: Any) -> AsyncIterator[str]:
    """An in-process gateway in front of ``workers`` (settings ``overrides``): its URL."""
    port = free_port()
    settings = dataclasses.replace(GatewaySettings(port=port, worker=tuple(workers)), **overrides)
    runner = await serve(create_gateway(settings), port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    """Wait until ``predicate`` holds (checked every 50 ms); AssertionError after
    ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def admin_workers(http: Any, gateway: str) -> dict[str, dict[str, Any]]:
    """``/admin/workers`` by worker id (``http``: an aiohttp client session)."""
    async with http.get(gateway + "/admin/workers") as response:
        return {w["id"]: w for w in (await response.json())["workers"]}

@dataclass
class Cluster:
    gateway_url: str
    worker_urls: list[str]
    runners: dict[str, web.AppRunner] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.gateway_url + "/v1"

    async def stop_worker(self, url: str) -> None:
        await self.runners.pop(url).cleanup()

    async def close(self) -> None:
        for runner in list(self.runners.values()):  # the gateway first, then its workers
            await runner.cleanup()
        self.runners.clear()


StartCluster = Callable[..., Awaitable[Cluster]]


def engine_stub() -> web.Application:
    """An application answering what the gateway's health probes ask an engine (``/health``,
    ``/v1/models`` with :data:`MODEL`, an empty ``/metrics``): a stand-in for an engine's wire
    behaviour adds its own routes to it."""
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


@pytest.fixture
async def start_cluster() -> AsyncIterator[StartCluster]:
    """Factory: ``await start_cluster(workers=4, policy=..., **gateway_overrides)``."""
    clusters: list[Cluster] = []

    async def start(
        workers: int = 4,
        worker_settings: WorkerSettings = FAST_WORKER,
        dead_workers: int = 0,
        scheme_prefix: str = "",
        span_exporter: SpanExporter | None = None,
        worker_span_exporter: SpanExporter | None = None,
        **gateway_overrides: Any,
    ) -> Cluster:
        runners: dict[str, web.AppRunner] = {}
        urls: list[str] = []
        for _ in range(workers):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            settings = dataclasses.replace(worker_settings, port=port)
            runners[url] = await serve(
                create_worker(settings, span_exporter=worker_span_exporter), port)
            urls.append(url)
        # Workers that were never started: connections to them are refused.
        urls += [f"http://127.0.0.1:{free_port()}" for _ in range(dead_workers)]
        gport = free_port()
        gsettings = dataclasses.replace(
            GatewaySettings(port=gport, worker=tuple(scheme_prefix + u for u in urls)),
            **gateway_overrides,
        )
        gateway_runner = await serve(
            create_gateway(gsettings, span_exporter=span_exporter), gport)
        cluster = Cluster(f"http://127.0.0.1:{gport}", urls, {"gateway": gateway_runner})
        cluster.runners.update(runners)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        await cluster.close()


# -- real processes: redis-server, workers and gateways as the user would run them ------------


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=0.2
            ):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs Debian's redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


class Processes:
    """Servers started as child processes; all stopped at the end of the test."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, module: str, *args: str, health_url: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        self.procs.append(proc)
        await wait_healthy(health_url, timeout_s=60)
        return proc

    async def worker(self, *args: str, store: str = "") -> tuple[str, asyncio.subprocess.Process]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        extra = ["--store", store, "--public-url", url] if store else []
        proc = await self.start(
            "worker", "--port", str(port), "--model", MODEL,
            "--prefill-us-per-token", "20", "--decode-ms-per-token", "2", *extra, *args,
            health_url=url,
        )
        return url, proc

    async def gateway(self, *args: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        await self.start("gateway", "--port", str(port), *args, health_url=url)
        return url

    async def stop_all(self) -> None:
        await stop_processes(self.procs, grace_s=10)


@pytest.fixture
async def processes() -> AsyncIterator[Processes]:
    procs = Processes()
    yield procs
    await procs.stop_all()


# -- a headless browser (tests.browser) ------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[object]:
    """Headless Chromium under selenium (use with ``tests.browser.needs_browser``)."""
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    assert CHROMIUM is not None
    assert DRIVER is not None
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1300", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
