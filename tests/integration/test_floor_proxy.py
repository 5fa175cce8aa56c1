"""The benchmark floor proxies relay bytes to their workers in turn, over real HTTP: aiohttp's
server with either client, its low-level server, and the bare protocol server (alone or building
aiohttp's request and response objects) with the gateway's relay client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.backends.http1 import Http1Client
from gateway.contracts.tasks import running
from loadtest.floor_proxy import BareHTTP, ObjectsHTTP, build_app, http1_relay, serve_lowlevel
from tests.conftest import free_port, serve


def _echo(name: str) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"worker": name, "path": request.path, "bytes": len(body)})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/completions", answer)
    return app


@contextlib.asynccontextmanager
async def _floor(kind: str, port: int, workers: list[str]) -> AsyncIterator[None]:
    if kind == "lowlevel":
        async with running(serve_lowlevel("127.0.0.1", port, workers), "floor-lowlevel"):
            for _ in range(100):  # until it listens
                with contextlib.suppress(OSError):
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    break
                await asyncio.sleep(0.02)
            yield
        return
    if kind not in ("protocol", "objects"):
        runner = await serve(build_app(workers, kind), port)
        try:
            yield
        finally:
            await runner.cleanup()
        return
    client = Http1Client(5.0, 30.0)
    relay = http1_relay(client, workers)
    protocol = ObjectsHTTP if kind == "objects" else BareHTTP
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(relay), "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()
        client.close()


@pytest.mark.parametrize("kind", ["aiohttp", "http1", "lowlevel", "protocol", "objects"])
async def test_requests_go_to_the_workers_in_turn_with_their_bodies(kind: str) -> None:
    ports = [free_port() for _ in range(3)]
    runners = [await serve(_echo(f"w{i}"), ports[i]) for i in range(2)]
    try:
        async with _floor(kind, ports[2], [f"http://127.0.0.1:{p}" for p in ports[:2]]):
            seen = []
            # One connection: the protocol server answers requests on it in turn.
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as http:
                for i, path in enumerate(["/v1/chat/completions", "/v1/completions"] * 2):
                    async with http.post(f"http://127.0.0.1:{ports[2]}{path}",
                                         data=b"x" * (i + 1)) as reply:
                        assert reply.status == 200
                        seen.append(await reply.json())
                async with http.get(f"http://127.0.0.1:{ports[2]}/health") as reply:
                    assert reply.status == 200
                # A body that arrives in many reads, then a short one on the same connection.
                for size in (1_000_000, 5):
                    async with http.post(f"http://127.0.0.1:{ports[2]}/v1/completions",
                                         data=b"y" * size) as reply:
                        assert reply.status == 200
                        assert (await reply.json())["bytes"] == size
            assert [(s["worker"], s["path"], s["bytes"]) for s in seen] == [
                ("w0", "/v1/chat/completions", 1), ("w1", "/v1/completions", 2),
                ("w0", "/v1/chat/completions", 3), ("w1", "/v1/completions", 4)]
    finally:
        for runner in runners:
            await runner.cleanup()
