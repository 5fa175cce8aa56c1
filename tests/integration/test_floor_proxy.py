"""The benchmark floor proxy relays bytes to its workers in turn, over real HTTP."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from loadtest.floor_proxy import build_app
from tests.conftest import free_port, serve


def _echo(name: str) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"worker": name, "path": request.path, "bytes": len(body)})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/completions", answer)
    return app


async def test_requests_go_to_the_workers_in_turn_with_their_bodies() -> None:
    ports = [free_port() for _ in range(3)]
    runners = [await serve(_echo(f"w{i}"), ports[i]) for i in range(2)]
    runners.append(await serve(build_app([f"http://127.0.0.1:{p}" for p in ports[:2]]),
                               ports[2]))
    try:
        seen = []
        async with aiohttp.ClientSession() as http:
            for i, path in enumerate(["/v1/chat/completions", "/v1/completions"] * 2):
                async with http.post(f"http://127.0.0.1:{ports[2]}{path}",
                                     data=b"x" * (i + 1)) as reply:
                    assert reply.status == 200
                    seen.append(await reply.json())
        assert [(s["worker"], s["path"], s["bytes"]) for s in seen] == [
            ("w0", "/v1/chat/completions", 1), ("w1", "/v1/completions", 2),
            ("w0", "/v1/chat/completions", 3), ("w1", "/v1/completions", 4)]
    finally:
        for runner in runners:
            await runner.cleanup()
