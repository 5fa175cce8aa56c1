"""The floor for a Python router: a bare aiohttp proxy (uvloop when installed).

``python -m loadtest.floor_proxy --port P --worker URL [--worker URL ...]`` relays each
completion request's bytes to the next worker in turn and its reply back: no parsing, no
routing, no telemetry, no limits. ``loadtest.bench_overhead --routers ...,floor`` runs it beside
our gateway and the Rust routers, so every run shows how much of our cost is aiohttp itself.
A benchmark baseline, not a product: it has none of the gateway's safety.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import itertools
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def build_app(workers: Sequence[str]) -> web.Application:
    turn = itertools.cycle([w.rstrip("/") for w in workers])

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app[SESSION].post(
            next(turn) + request.path, data=body,
            headers={"Content-Type": "application/json"},
        ) as reply:
            payload = await reply.read()
            return web.Response(body=payload, status=reply.status,
                                content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.floor_proxy", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", action="append", required=True)
    args = p.parse_args(argv)
    try:
        loop: asyncio.AbstractEventLoop = importlib.import_module("uvloop").new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    web.run_app(build_app(args.worker), host=args.host, port=args.port, access_log=None,
                print=None, loop=loop)


if __name__ == "__main__":
    main()
