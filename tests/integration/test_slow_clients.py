"""A whole answer's bookkeeping once it is handed to the client: a client that reads slowly
does not keep its worker counted busy, and still gets the whole answer.

The gateway settles an attempt (the worker's cache report, its in-flight count) after the
answer is written, off the client's time; when the write must wait for the client, it settles
at the event loop's next pass instead of after the client has read everything.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
from aiohttp import web

from tests.conftest import MODEL, admin_workers, engine_stub, free_port, gateway_over, serve, until

ANSWER_CHARS = 24 * 1024 * 1024  # far more than the sockets between gateway and client hold


def _large_answer_worker() -> web.Application:
    app = engine_stub()

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        body = {"id": "cmpl-large", "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": "x" * ANSWER_CHARS, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
        return web.json_response(body, headers={"x-cache-input-tokens": "4",
                                                 "x-cache-matched-tokens": "0"})

    app.router.add_post("/v1/completions", completions)
    return app


async def _inflight(http: aiohttp.ClientSession, gateway: str) -> int:
    return sum(int(w["inflight_requests"]) for w in (await admin_workers(http, gateway)).values())


async def test_a_slow_client_of_a_large_answer_does_not_keep_its_worker_busy() -> None:
    port = free_port()
    runner = await serve(_large_answer_worker(), port)
    try:
        async with gateway_over([f"http://127.0.0.1:{port}"]) as gateway, \
                aiohttp.ClientSession() as http:
            host, gateway_port = gateway.removeprefix("http://").split(":")
            body = json.dumps({"model": MODEL, "prompt": "a prompt", "max_tokens": 1}).encode()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader
            sock.connect((host, int(gateway_port)))
            sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            # The worker answered at once; the client has read nothing yet, and the gateway
            # holds most of the answer for it: the worker is no longer counted busy.
            seen_busy: list[int] = []

            async def settled() -> bool:
                seen_busy.append(await _inflight(http, gateway))
                return seen_busy[-1] == 0

            await asyncio.sleep(0.2)  # the worker's answer has reached the gateway
            await until(settled, timeout_s=10.0)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head[:100]
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            answer: Any = json.loads(await reader.readexactly(length))
            assert len(answer["choices"][0]["text"]) == ANSWER_CHARS
            writer.close()
            workers = await admin_workers(http, gateway)
            assert [w["inflight_requests"] for w in workers.values()] == [0]
    finally:
        await runner.cleanup()
