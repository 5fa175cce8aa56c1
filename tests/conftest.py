"""Shared fixtures: real servers on 127.0.0.1 in the test's event loop.

``Cluster`` starts reference workers (the simulated engine, with real cache bookkeeping) and a
gateway in front of them, each on its own free port with real sockets and real HTTP between
them. Nothing of ours is mocked.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.settings import GatewaySettings
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


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


@pytest.fixture
async def start_cluster() -> AsyncIterator[StartCluster]:
    """Factory: ``await start_cluster(workers=4, policy=..., **gateway_overrides)``."""
    clusters: list[Cluster] = []

    async def start(
        workers: int = 4,
        worker_settings: WorkerSettings = FAST_WORKER,
        dead_workers: int = 0,
        **gateway_overrides: Any,
    ) -> Cluster:
        runners: dict[str, web.AppRunner] = {}
        urls: list[str] = []
        for _ in range(workers):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            settings = dataclasses.replace(worker_settings, port=port)
            runners[url] = await serve(create_worker(settings), port)
            urls.append(url)
        # Workers that were never started: connections to them are refused.
        urls += [f"http://127.0.0.1:{free_port()}" for _ in range(dead_workers)]
        gport = free_port()
        gsettings = dataclasses.replace(
            GatewaySettings(port=gport, worker=tuple(urls)), **gateway_overrides
        )
        gateway_runner = await serve(create_gateway(gsettings), gport)
        cluster = Cluster(f"http://127.0.0.1:{gport}", urls, {"gateway": gateway_runner})
        cluster.runners.update(runners)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        await cluster.close()
