"""The lean HTTP/1.1 path (gateway.contracts.lean_http) over real sockets: what it serves
itself, what it hands to aiohttp's server with the connection, and its connection's life."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.contracts.httpserver import JsonErrorRequestHandler, JsonErrorRunner
from gateway.contracts.lean_http import LeanConnection
from gateway.settings import GatewaySettings
from tests.conftest import FAST_WORKER, MODEL, Cluster, StartCluster, free_port


def _port(cluster: Cluster) -> int:
    return int(cluster.gateway_url.rsplit(":", 1)[1])


def _kinds(cluster: Cluster) -> list[str]:
    """Which server holds each open client connection of the gateway."""
    server = cluster.runners["gateway"].server
    assert server is not None
    return sorted(type(conn).__name__ for conn in server._connections)


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def _completion(prompt: str, **fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields}).encode()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One whole answer (a Content-Length body) from ``reader``."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
    lines = head.split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(lines[0].split(" ")[1]), headers, body


async def test_plain_completions_are_served_on_the_lean_path_in_turn(
    start_cluster: StartCluster,
) -> None:
    # Two requests pipelined in one write, then a third on the same connection: each answered
    # whole, in order, with the gateway's headers; the connection stays a lean one.
    cluster = await start_cluster(workers=2)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(cluster))
    try:
        writer.write(_post("/v1/completions", _completion("one"), b"x-request-id: first-1\r\n")
                     + _post("/v1/chat/completions", json.dumps({
                         "model": MODEL, "max_tokens": 1,
                         "messages": [{"role": "user", "content": "two"}]}).encode(),
                         b"x-request-id: second-2\r\n"))
        await writer.drain()
        for expected, kind in (("first-1", "text_completion"), ("second-2", "chat.completion")):
            status, headers, body = await _answer(reader)
            assert status == 200
            assert headers["x-request-id"] == expected
            assert headers["server"] == "affinity-gateway"
            assert headers["x-route-policy"] == "cache_aware"
            assert "date" in headers
            assert "connection" not in headers
            assert json.loads(body)["object"] == kind
        assert _kinds(cluster) == ["LeanConnection"]
        # "stream": false asks for a whole answer: the lean path serves it.
        writer.write(_post("/v1/completions", _completion("three", stream=False)))
        await writer.drain()
        status, _, body = await _answer(reader)
        assert status == 200
        assert json.loads(body)["object"] == "text_completion"
        assert _kinds(cluster) == ["LeanConnection"]
        # The probes and views clients ask for between completions stay on it too.
        for path in (b"/health", b"/v1/models", b"/metrics"):
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: gateway\r\n\r\n")
            await writer.drain()
            status, _, body = await _answer(reader)
            assert status == 200
        assert _kinds(cluster) == ["LeanConnection"]
        # A request the lean path does not take hands the connection to aiohttp for good.
        writer.write(b"GET /v1/models/" + MODEL.encode() + b" HTTP/1.1\r\nHost: gateway\r\n\r\n")
        await writer.drain()
        status, _, body = await _answer(reader)
        assert (status, json.loads(body)["id"]) == (200, MODEL)
        assert _kinds(cluster) == ["JsonErrorRequestHandler"]
        writer.write(_post("/v1/completions", _completion("four")))
        await writer.drain()
        status, _, _ = await _answer(reader)
        assert status == 200
    finally:
        writer.close()


async def test_what_the_lean_path_does_not_take_goes_to_aiohttp_whole(
    start_cluster: StartCluster,
) -> None:
    # Each on a fresh connection: aiohttp's server answers it as it would with no lean path.
    cluster = await start_cluster(workers=1, max_body_bytes=200_000)
    port = _port(cluster)

    async def exchange(data: bytes, then: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            await writer.drain()
            if then:
                await asyncio.sleep(0.2)
                writer.write(then)
                await writer.drain()
            return await _answer(reader)
        finally:
            writer.close()

    body = _completion("chunked")
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body
               + b"\r\n0\r\n\r\n")
    assert (await exchange(chunked))[0] == 200
    # A body that arrives after its head, and one over the lean path's 64 KiB.
    whole = _post("/v1/completions", _completion("split"))
    assert (await exchange(whole[:-10], whole[-10:]))[0] == 200
    assert (await exchange(_post("/v1/completions", _completion("x" * 70_000))))[0] == 200
    # Both framings at once (request smuggling): aiohttp's 400, in the OpenAI shape.
    both = (b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    status, _, answer = await exchange(both)
    assert status == 400
    assert "error" in json.loads(answer)
    # A header name with a space before its colon.
    bad = (b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nX-Bad : 1\r\n"
           b"Content-Length: 2\r\n\r\n{}")
    status, _, answer = await exchange(bad)
    assert status == 400
    assert "error" in json.loads(answer)

    # A stream goes through aiohttp's writer, event by event, its connection handed over.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_post("/v1/completions", _completion("s", stream=True)))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"text/event-stream" in head
        assert "LeanConnection" not in _kinds(cluster)  # this one, open, is aiohttp's now
    finally:
        writer.close()
    async with aiohttp.ClientSession() as http, http.post(
            cluster.base_url + "/completions",
            json={"model": MODEL, "prompt": "s", "max_tokens": 3, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    assert text.rstrip().endswith("data: [DONE]")


async def test_a_client_gone_mid_request_stops_its_handler(start_cluster: StartCluster) -> None:
    # The worker takes about 4 s to answer; the client leaves after 0.3 s. Its request stops
    # counting on the worker at once (the handler is cancelled), not when the worker answers.
    slow = dataclasses.replace(FAST_WORKER, decode_ms_per_token=100.0)
    cluster = await start_cluster(workers=1, worker_settings=slow)
    _, writer = await asyncio.open_connection("127.0.0.1", _port(cluster))
    writer.write(_post("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "slow", "max_tokens": 40}).encode()))
    await writer.drain()

    async def in_flight() -> int:
        async with aiohttp.ClientSession() as http, \
                http.get(cluster.gateway_url + "/admin/workers") as r:
            return sum(w["inflight_requests"] for w in (await r.json())["workers"])

    for _ in range(40):
        if await in_flight() == 1:
            break
        await asyncio.sleep(0.05)
    assert await in_flight() == 1
    await asyncio.sleep(0.3)
    writer.close()
    for _ in range(40):  # 2 s, well before the worker's answer
        if await in_flight() == 0:
            break
        await asyncio.sleep(0.05)
    assert await in_flight() == 0


async def test_an_idle_lean_connection_is_closed(start_cluster: StartCluster) -> None:
    # A gateway served with a 0.5 s idle timeout: a connection that never sends a head, and
    # one that answered a request and then sends nothing, are both closed by the gateway.
    workers = await start_cluster(workers=1)
    port = free_port()
    runner = JsonErrorRunner(
        create_gateway(GatewaySettings(port=port, worker=tuple(workers.worker_urls))),
        access_log=None, idle_timeout_s=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/v1/completions", _completion("then idle")))
        await writer.drain()
        assert (await _answer(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_connection_handed_over_keeps_its_place_under_the_cap(
    start_cluster: StartCluster,
) -> None:
    # Cap of 2: a lean connection handed to aiohttp still counts once, not twice or not at all.
    cluster = await start_cluster(workers=1, max_client_connections=2)
    port = _port(cluster)
    server = cluster.runners["gateway"].server
    assert server is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /openapi.json HTTP/1.1\r\nHost: g\r\n\r\n")  # aiohttp's
    await writer.drain()
    assert (await _answer(reader))[0] == 200
    cap = server.cap  # type: ignore[attr-defined]
    assert cap.open == 1
    assert [type(c) for c in server._connections] == [JsonErrorRequestHandler]
    other, other_writer = await asyncio.open_connection("127.0.0.1", port)
    other_writer.write(_post("/v1/completions", _completion("lean")))
    await other_writer.drain()
    assert (await _answer(other))[0] == 200
    assert cap.open == 2
    assert sorted(type(c).__name__ for c in server._connections) == [
        "JsonErrorRequestHandler", "LeanConnection"]
    assert any(isinstance(c, LeanConnection) for c in server._connections)
    writer.close()
    other_writer.close()
    for _ in range(40):
        if cap.open == 0:
            break
        await asyncio.sleep(0.05)
    assert cap.open == 0
