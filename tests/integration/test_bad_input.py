"""Nothing a client sends gets a 5xx: the catalogue of hostile inputs, as table tests against a
live gateway with reference workers; aiohttp's own errors come in the OpenAI shape too."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.openai_schema import ParsedRequest
from tests.conftest import MODEL, Cluster, Processes, StartCluster, free_port

KEY = "sk-catalogue"


@pytest.fixture
async def cluster(start_cluster: StartCluster) -> Cluster:
    return await start_cluster(workers=2, api_key=(f"{KEY}:cat",))


def _raw(text: str, *numbers: str) -> bytes:
    """``text`` with ``@MODEL`` replaced by the served model and each ``@N`` by a number."""
    for number in numbers:
        text = text.replace("@N", number, 1)
    return text.replace("@MODEL", MODEL).encode("utf-8")


NESTED = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "extra": ' + b"[" * 100_000 \
    + b"]" * 100_000 + b"}"
BODIES: list[tuple[str, bytes, str | None]] = [
    ("lone surrogate in prompt",
     _raw('{"model": "@MODEL", "prompt": "a \\ud800 b"}'), None),
    ("lone low surrogate in chat",
     _raw('{"model": "@MODEL", "messages": [{"role": "user", "content": "\\udfff"}]}'), None),
    ("lone surrogate in model", _raw('{"model": "\\ud83d", "prompt": "x"}'), None),
    ("lone surrogate in cache_salt",
     _raw('{"model": "@MODEL", "prompt": "x", "cache_salt": "\\udc80"}'), None),
    ("lone surrogate in a key", _raw('{"model": "@MODEL", "prompt": "x", "\\ud800": 1}'),
     None),
    ("JSON nested 100k deep", NESTED, None),
    ("object nested 100k deep", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, None),
    ("integer over 4,300 digits",
     _raw('{"model": "@MODEL", "prompt": "x", "seed": @N}', "9" * 5000), None),
    ("max_tokens 10**400",
     _raw('{"model": "@MODEL", "prompt": "x", "max_tokens": 1@N}', "0" * 400), None),
    ("n 10**400", _raw('{"model": "@MODEL", "prompt": "x", "n": 1@N}', "0" * 400), None),
    ("max_tokens 10**12", _raw('{"model": "@MODEL", "prompt": "x", "max_tokens": 1@N}',
                               "0" * 12), "max_tokens"),
    ("n 10**6", _raw('{"model": "@MODEL", "prompt": "x", "n": 1@N}', "0" * 6), "n"),
    ("max_completion_tokens negative",
     _raw('{"model": "@MODEL", "messages": [{"role": "user", "content": "x"}], '
          '"max_completion_tokens": -1}'), "max_completion_tokens"),
    ("token id 10**30", _raw('{"model": "@MODEL", "prompt": [1@N]}', "0" * 30), None),
    ("temperature 1e400", _raw('{"model": "@MODEL", "prompt": "x", "max_tokens": 1, '
                               '"temperature": 1e400}'), None),
    ("NaN max_tokens", _raw('{"model": "@MODEL", "prompt": "x", "max_tokens": NaN}'), None),
    ("not UTF-8", b'{"model": "\xff\xfe", "prompt": "x"}', None),
    ("not JSON", b"model=sim&prompt=x", None),
    ("empty", b"", None),
    ("a list", b"[]", None),
    ("huge model name", _raw('{"model": "@N", "prompt": "x"}', "m" * 1_000_000), "model"),
]


@pytest.mark.parametrize(("name", "body", "param"), BODIES, ids=[b[0] for b in BODIES])
async def test_hostile_bodies_get_openai_shaped_4xx(
    cluster: Cluster, name: str, body: bytes, param: str | None
) -> None:
    async with aiohttp.ClientSession() as http, http.post(
        cluster.base_url + "/completions", data=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    ) as r:
        payload = await r.json()
        assert 400 <= r.status < 500 or r.status == 200, (r.status, payload)
        if r.status != 200:
            assert set(payload["error"]) >= {"message", "type", "param", "code"}
            assert len(payload["error"]["message"]) < 2000
            if param is not None:
                assert payload["error"]["param"] == param


async def _exchange(cluster: Cluster, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    return await _exchange_at(cluster.gateway_url, raw)


async def _exchange_at(url: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
        return status, headers, body
    finally:
        writer.close()


def _request(*headers: str, body: bytes = b"", path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


GOOD = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
WIRE: list[tuple[str, bytes, set[int]]] = [
    ("non-UTF-8 Authorization",
     _request("Content-Type: application/json", f"Content-Length: {len(GOOD)}", body=GOOD)
     .replace(b"Host: gateway", b"Host: gateway\r\nAuthorization: Bearer \xff\xfe\xfa"), {401}),
    ("huge header", _request("X-Big: " + "a" * 100_000, "Content-Length: 0"), {400, 431}),
    ("many headers", _request(*[f"X-H{i}: v" for i in range(500)], "Content-Length: 0"),
     {400, 401, 431}),
    ("Content-Length and Transfer-Encoding",
     _request("Content-Length: 4", "Transfer-Encoding: chunked", body=b"0\r\n\r\n"), {400}),
    ("two Content-Lengths", _request("Content-Length: 2", "Content-Length: 3", body=b"{}"),
     {400}),
    ("bad chunk size",
     _request("Transfer-Encoding: chunked", body=b"zz\r\nabc\r\n0\r\n\r\n"), {400}),
    ("obfuscated Transfer-Encoding",
     _request("Transfer-Encoding: xchunked", "Content-Length: 2", body=b"{}"), {400, 401, 501}),
    ("space before colon", _request("Content-Length : 2", body=b"{}"), {400}),
    ("bad method", b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("bad version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", {400, 505}),
    ("NUL in header", _request("X-A: a\x00b", "Content-Length: 0"), {400}),
]


@pytest.mark.parametrize(("name", "raw", "statuses"), WIRE, ids=[w[0] for w in WIRE])
async def test_malformed_http_gets_openai_shaped_4xx(
    cluster: Cluster, name: str, raw: bytes, statuses: set[int]
) -> None:
    status, headers, body = await _exchange(cluster, raw)
    assert status in statuses, (status, body[:200])
    assert headers["content-type"].startswith("application/json")
    assert headers["server"] == "affinity-gateway"  # not aiohttp's and Python's versions
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(("raw", "status"), [
    (_request(f"Authorization: Bearer {KEY}", "Content-Type: application/json",
              f"Content-Length: {len(GOOD)}", body=GOOD), 200),
    (_request("Content-Type: application/json", f"Content-Length: {len(GOOD)}", body=GOOD),
     401),
    (b"GET /no/such/path HTTP/1.1\r\nHost: gateway\r\n\r\n", 404),
    (b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n", 200),
], ids=["answered", "no key", "no such path", "health"])
async def test_no_response_names_the_servers_software_versions(
    cluster: Cluster, raw: bytes, status: int
) -> None:
    got, headers, body = await _exchange(cluster, raw)
    assert got == status, body[:200]
    assert headers["server"] == "affinity-gateway"
    assert not any("aiohttp" in v or "Python/" in v for v in headers.values()), headers


async def test_worker_process_answers_malformed_http_in_openai_shape(
    processes: Processes,
) -> None:
    url, _ = await processes.worker()
    for name, raw, statuses in WIRE:
        if name == "non-UTF-8 Authorization":
            continue  # a gateway matter (keys); the worker here has none
        status, headers, body = await _exchange_at(url, raw.replace(b"/v1/completions",
                                                                    b"/v1/chat/completions"))
        assert status in statuses, (name, status, body[:200])
        assert headers["content-type"].startswith("application/json"), (name, body[:200])
        assert headers["server"] == "affinity-worker", name
        error: dict[str, Any] = json.loads(body)["error"]
        assert error["message"], name


async def test_aborted_upload_is_one_log_line(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    host, port = cluster.gateway_url.removeprefix("http://").split(":")
    for _ in range(5):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(_request(f"Authorization: Bearer {KEY}", "Content-Type: application/json",
                              "Content-Length: 100000", body=b'{"model": "sim'))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()
    await asyncio.sleep(0.3)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 0
    # The gateway still serves.
    async with aiohttp.ClientSession() as http, http.post(
        cluster.base_url + "/completions", data=GOOD,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    ) as r:
        assert r.status == 200


@contextlib.asynccontextmanager
async def _posted_uncollected(url: str, raw: bytes) -> AsyncIterator[aiohttp.ClientResponse]:
    """``raw`` posted to ``url`` with the cyclic collector paused (after one full pass): what
    is alive in the block is held by a reference, not left for want of a collection."""
    gc.collect()
    gc.disable()
    try:
        async with aiohttp.ClientSession() as http, http.post(
                url, data=raw, headers={"Content-Type": "application/json"}) as r:
            yield r
    finally:
        gc.enable()


@pytest.mark.parametrize("case", ["no worker", "invalid", "answered"])
async def test_an_answer_does_not_keep_its_request_alive(
    start_cluster: StartCluster, case: str
) -> None:
    """Once a request is answered, its decoded body is freed at once, not left to the
    collector's rare full passes (a cycle through the error's traceback kept it: over 100 MB
    for an 8 MiB body of tiny items, per request)."""
    cluster = await (start_cluster(workers=0, dead_workers=1) if case == "no worker"
                     else start_cluster(workers=1))
    marker = f"marker-{case}-{id(cluster)}"
    body = {"model": MODEL, "prompt": [marker, "b"], "max_tokens": 1}
    if case == "invalid":
        body["n"] = 0
    raw = json.dumps(body).encode()
    del body

    def alive() -> int:
        return sum(1 for o in gc.get_objects()
                   if type(o) is dict and o.get("prompt") == [marker, "b"])

    async with _posted_uncollected(cluster.gateway_url + "/v1/completions", raw) as r:
        assert r.status == {"no worker": 503, "invalid": 400, "answered": 200}[case]
        await r.read()
        await asyncio.sleep(0.05)
        assert alive() == 0


async def test_a_running_request_no_longer_holds_its_parse(
    start_cluster: StartCluster, processes: Processes,
) -> None:
    """While a request waits for its place and its worker and while its answer streams, the
    gateway keeps what it forwards (the body as decoded, with the client's bytes), not the
    request's parse (its rendered prompt text, a chat's history). The worker runs in its own
    process: only the gateway's objects are here."""
    worker, _ = await processes.worker()
    cluster = await start_cluster(workers=0, worker=(worker,))
    marker = f"marker-running-{id(cluster)}"
    raw = json.dumps({"model": MODEL, "prompt": [marker, "b"], "max_tokens": 150,
                      "stream": True}).encode()

    def parses() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is ParsedRequest
                   and o.body.get("prompt") == [marker, "b"])

    async with _posted_uncollected(cluster.gateway_url + "/v1/completions", raw) as r:
        assert r.status == 200
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        assert not r.content.at_eof()  # the answer is still streaming
        assert parses() == 0
        rest = await r.read()
        assert rest.rstrip().endswith(b"data: [DONE]")


async def test_slow_or_idle_connections_are_closed(processes: Processes) -> None:
    """A client that trickles a request's head, or keeps a connection idle, holds it for
    ``--idle-timeout-s`` at most (the gateway process, as run from the command line)."""
    worker, _ = await processes.worker()
    gateway = await processes.gateway("--worker", worker, "--idle-timeout-s", "1")
    host, port = gateway.removeprefix("http://").split(":")
    trickling = await asyncio.open_connection(host, int(port))
    trickling[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n")
    idle = await asyncio.open_connection(host, int(port))
    idle[1].write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
    await idle[0].readuntil(b"\r\n\r\n")
    try:
        for reader, writer in (trickling, idle):
            for _ in range(3):  # a header line now and then does not keep it open
                await asyncio.sleep(0.2)
                if writer is trickling[1]:
                    writer.write(b"X-Slow: 1\r\n")
            rest = await asyncio.wait_for(reader.read(), 20)
            assert reader.at_eof()
            assert b"HTTP/1.1 2" not in rest
    finally:
        for _, writer in (trickling, idle):
            writer.close()


async def test_connections_past_the_cap_make_room_or_are_answered_503(
    processes: Processes,
) -> None:
    """With ``--max-client-connections 3``: a fourth connection takes the place of the oldest
    one without a request in progress (idle, or still sending its head), which is closed;
    with three requests in progress, it gets a 503 in the OpenAI shape and is closed, while
    the loopback admin port still answers and no request in progress is cut off."""
    worker, _ = await processes.worker()
    admin_port = free_port()
    gateway = await processes.gateway("--worker", worker, "--max-client-connections", "3",
                                      "--admin-port", str(admin_port))
    host, port = gateway.removeprefix("http://").split(":")

    async def scrape() -> str:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
            return await r.text()

    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        return await asyncio.wait_for(reader.read(), 10)

    async def kept_alive_health() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        return reader, writer  # open, idle between requests

    idle = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
    idle[1][1].write(b"POST /v1/completions HTTP/1.1\r\nHost: ga")  # a head, trickling
    busy: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    served: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await asyncio.sleep(0.2)
        for _ in range(3):  # each takes the place of the oldest without a request
            served.append(await kept_alive_health())
        for reader, _ in idle:  # all three closed by the gateway, the trickling one too
            assert await asyncio.wait_for(reader.read(), 10) == b""
        scraped = await scrape()
        assert "gateway_evicted_connections_total 3.0" in scraped
        assert "gateway_refused_connections_total 0.0" in scraped
        for _, writer in served:
            writer.close()
        await asyncio.sleep(0.3)
        stream = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2000,
                             "stream": True}).encode()
        for _ in range(3):  # three requests in progress: no room to make
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(stream), stream))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 ")
            busy.append((reader, writer))
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"server: affinity-gateway" in head.lower()
        error = json.loads(body)["error"]
        assert "too many connections" in error["message"]
        assert error["type"] == "server_error"
        scraped = await scrape()
        assert "gateway_refused_connections_total 1.0" in scraped
        assert "gateway_client_connection_cap 3.0" in scraped
        assert "gateway_client_connections 3.0" in scraped
        for reader, _ in busy:  # the streams go on
            assert (await asyncio.wait_for(reader.read(200), 10)).strip()
        busy.pop()[1].close()
        await asyncio.sleep(0.3)
        assert (await health(*await asyncio.open_connection(host, int(port)))).startswith(
            b"HTTP/1.1 200 ")
    finally:
        for _, w in idle + served + busy:
            w.close()
