"""The relay's HTTP/1.1 client against a raw TCP server over 127.0.0.1 that writes exactly the
bytes each case needs: framings, interim replies, kept-alive and closed connections, failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from yarl import URL

from gateway.backends.base import BackendUnavailable, UpstreamBrokeOff
from gateway.backends.http1 import Http1Client
from tests.conftest import free_port

# What the server does with the n-th request (from 0) on the c-th connection (from 0): returns
# the pieces to write, each flushed on its own (None: close the connection instead of replying).
Script = Callable[[int, int, bytes], list[bytes] | None]


@dataclass
class RawServer:
    script: Script
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                pieces = self.script(conn, n, body)
                n += 1
                if pieces is None:
                    break
                for piece in pieces:
                    if piece == b"<close>":
                        writer.close()
                        return
                    if piece.startswith(b"<sleep "):
                        await asyncio.sleep(float(piece[7:-1]))
                        continue
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went, or the test ended
        writer.close()

    @property
    def url(self) -> URL:
        return URL(f"http://127.0.0.1:{self.port}/v1/completions")


Serve = Callable[[Script], Awaitable[RawServer]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> RawServer:
        raw = RawServer(script, port=free_port())
        servers.append(await asyncio.start_server(raw.handle, "127.0.0.1", raw.port))
        return raw

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def _ok(body: bytes, *headers: bytes) -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"".join(
        h + b"\r\n" for h in headers)
    return [head + b"Content-Length: %d\r\n\r\n" % len(body) + body]


def _client(**kwargs: float) -> Http1Client:
    return Http1Client(connect_timeout_s=kwargs.get("connect", 2.0),
                       read_timeout_s=kwargs.get("read", 5.0))


async def test_content_length_replies_reuse_one_connection(serve: Serve) -> None:
    server = await serve(lambda c, n, body: _ok(b'{"n": %d}' % n))
    client = _client()
    for n in range(3):
        reply = await client.post(server.url, {"x-request-id": f"r{n}"}, b'{"prompt": "hi"}')
        assert reply.status == 200
        assert reply.headers["content-type"] == "application/json"
        assert await reply.read() == b'{"n": %d}' % n
        reply.release()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in first
    assert b"\r\nx-request-id: r0\r\n" in first
    assert first.endswith(b'\r\n\r\n{"prompt": "hi"}')
    client.close()


async def test_a_get_says_nothing_of_a_length_it_does_not_have(serve: Serve) -> None:
    server = await serve(lambda c, n, body: _ok(b"ok"))
    client = _client()
    for method, body in (("GET", b""), ("POST", b""), ("GET", b"?")):
        reply = await client.send(server.url, {}, body, method)
        assert await reply.read() == b"ok"
        reply.release()
    get, post, odd_get = server.requests
    assert get.startswith(b"GET /v1/completions HTTP/1.1\r\n")
    assert b"content-length" not in get.lower()
    assert b"\r\nContent-Length: 0\r\n" in post
    assert b"\r\nContent-Length: 1\r\n" in odd_get  # a GET with content keeps its length
    client.close()


async def test_chunked_reply_split_byte_by_byte(serve: Serve) -> None:
    wire = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            b"6;ext=1\r\ndata: \r\n0a\r\n{\"a\": 1}\n\n\r\n0\r\nX-Trailer: t\r\n\r\n")
    server = await serve(lambda c, n, body: [wire[i:i + 1] for i in range(len(wire))])
    client = _client()
    for _ in range(2):
        reply = await client.post(server.url, {}, b"{}")
        assert reply.status == 200
        assert b"".join([c async for c in reply.chunks()]) == b'data: {"a": 1}\n\n'
        reply.release()
    assert server.connections == 1  # the whole chunked reply was read: kept alive
    client.close()


async def test_interim_reply_is_skipped(serve: Serve) -> None:
    server = await serve(lambda c, n, body: [b"HTTP/1.1 100 Continue\r\n\r\n", *_ok(b"done")])
    client = _client()
    reply = await client.post(server.url, {}, b"{}")
    assert (reply.status, await reply.read()) == (200, b"done")
    reply.release()
    client.close()


@pytest.mark.parametrize(("pieces", "reused"), [
    pytest.param([b"HTTP/1.1 200 OK\r\n\r\nto the end", b"<close>"], False, id="until-close"),
    pytest.param(_ok(b"bye", b"Connection: close"), False, id="connection-close"),
    pytest.param([b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"], False, id="http-1.0"),
    pytest.param(_ok(b"ok", b"Connection: keep-alive"), True, id="keep-alive"),
    pytest.param([b"HTTP/1.1 204 No Content\r\n\r\n"], True, id="no-content"),
])
async def test_which_replies_keep_the_connection(serve: Serve, pieces: list[bytes],
                                                 reused: bool) -> None:
    server = await serve(lambda c, n, body: pieces)
    client = _client()
    bodies = []
    for _ in range(2):
        reply = await client.post(server.url, {}, b"{}")
        bodies.append(await reply.read())
        reply.release()
    assert bodies[0] == bodies[1]
    assert server.connections == (1 if reused else 2)
    client.close()


async def test_a_kept_connection_closed_by_the_worker_is_retried_once(serve: Serve) -> None:
    # The worker drops its idle connection as the second request arrives on it.
    server = await serve(lambda c, n, body: None if n == 1 else _ok(b"ok"))
    client = _client()
    for _ in range(2):
        reply = await client.post(server.url, {}, b"{}")
        assert (reply.status, await reply.read()) == (200, b"ok")
        reply.release()
    assert server.connections == 2
    assert len(server.requests) == 3  # the dropped one, then the same request again
    client.close()


async def test_a_new_connection_closed_before_a_reply_is_unavailable(serve: Serve) -> None:
    server = await serve(lambda c, n, body: None)
    client = _client()
    with pytest.raises(BackendUnavailable, match="closed the connection before its reply"):
        await client.post(server.url, {}, b"{}")
    assert server.connections == 1  # not retried: the connection was not a kept-alive one
    client.close()


@pytest.mark.parametrize(("pieces", "message"), [
    pytest.param([b"SPDY/3 200 OK\r\n\r\n"], "not an HTTP/1.1 status line", id="status-line"),
    pytest.param([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "malformed header",
                 id="header-line"),
    pytest.param([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"],
                 "Content-Length", id="two-lengths"),
    pytest.param([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"],
                 "Transfer-Encoding", id="not-chunked"),
    pytest.param([b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000], "too large", id="huge-head"),
    # Digits of other scripts, which str.isdigit takes (latin-1: a superscript two).
    pytest.param([b"HTTP/1.1 2\xb20 OK\r\n\r\n"], "not an HTTP/1.1 status line",
                 id="status-not-ascii"),
    pytest.param([b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n"], "Content-Length",
                 id="length-not-ascii"),
])
async def test_malformed_heads_are_unavailable(serve: Serve, pieces: list[bytes],
                                               message: str) -> None:
    server = await serve(lambda c, n, body: pieces)
    client = _client()
    with pytest.raises(BackendUnavailable, match=message):
        await client.post(server.url, {}, b"{}")
    client.close()


@pytest.mark.parametrize("pieces", [
    pytest.param([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", b"<close>"],
                 id="short-body"),
    pytest.param([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", b"<close>"],
                 id="short-chunk"),
    pytest.param([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
                 id="bad-chunk-size"),
    # Sizes int() reads but HTTP does not allow; a negative one once sent the parser back over
    # what it had read, forever (the gateway's event loop with it).
    *(pytest.param([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc",
                    b"<sleep 0.05>", b"\r\n" + size + b"\nh", b"ello0\r\n\r\n"],
                   id=f"chunk-size-{size.decode()}")
      for size in (b"-1", b"-100000", b"+3", b"0x3", b"1_0", b"1" * 17)),
])
async def test_a_reply_broken_mid_body_raises(serve: Serve, pieces: list[bytes]) -> None:
    server = await serve(lambda c, n, body: pieces)
    client = _client()
    reply = await client.post(server.url, {}, b"{}")
    assert reply.status == 200
    with pytest.raises(UpstreamBrokeOff):
        await reply.read()
    reply.release()
    client.close()


async def test_timeouts(serve: Serve) -> None:
    stalls = await serve(lambda c, n, body: [b"<sleep 5>"])
    client = _client(read=0.2)
    with pytest.raises(BackendUnavailable, match="TimeoutError"):
        await client.post(stalls.url, {}, b"{}")
    mid = await serve(lambda c, n, body: [
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhalf", b"<sleep 5>"])
    reply = await client.post(mid.url, {}, b"{}")
    with pytest.raises(TimeoutError):
        await reply.read()
    reply.release()
    client.close()


async def test_the_read_timeout_is_per_wait_not_per_reply(serve: Serve) -> None:
    # Chunks 0.08 s apart under a 0.2 s read timeout: 0.5 s in all, never one wait that long.
    # The connection's one timer fires while the reply is still moving and must re-arm itself
    # for the current wait; a timer per reply would time this out.
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for _ in range(6):
        pieces += [b"<sleep 0.08>", b"2\r\nab\r\n"]
    pieces.append(b"0\r\n\r\n")
    stalled = [b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhalf", b"<sleep 5>"]
    server = await serve(lambda c, n, body: pieces if n == 0 else stalled)
    client = _client(read=0.2)
    reply = await client.post(server.url, {}, b"{}")
    assert [c async for c in reply.chunks()] == [b"ab"] * 6
    reply.release()
    # The next request reuses the connection and its timer: a wait past the limit still ends.
    reply = await client.post(server.url, {}, b"{}")
    with pytest.raises(TimeoutError):
        await reply.read()
    reply.release()
    client.close()


async def test_a_head_wait_is_timed_from_its_own_request(serve: Serve) -> None:
    # Under a 0.3 s read timeout: the first reply comes at once (the connection's timer is
    # armed then), the second head 0.2 s after its request, sent 0.2 s later (so the timer,
    # armed for the first request's deadline, fires while the second waits, and must re-arm
    # for its deadline instead of failing it), and the third head never.
    def script(c: int, n: int, body: bytes) -> list[bytes]:
        return [*((b"<sleep 0.2>",) if n == 1 else ()),
                *((b"<sleep 5>",) if n == 2 else _ok(b"ok"))]

    server = await serve(script)
    client = _client(read=0.3)
    reply = await client.post(server.url, {}, b"{}")
    assert await reply.read() == b"ok"
    reply.release()
    await asyncio.sleep(0.2)
    reply = await client.post(server.url, {}, b"{}")
    assert await reply.read() == b"ok"
    reply.release()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BackendUnavailable, match="TimeoutError"):
        await client.post(server.url, {}, b"{}")
    assert loop.time() - started >= 0.29  # the whole limit, not what an earlier timer had left
    assert server.connections == 1
    client.close()


async def test_connection_refused_is_unavailable() -> None:
    client = _client()
    with pytest.raises(BackendUnavailable):
        await client.post(URL(f"http://127.0.0.1:{free_port()}/v1/completions"), {}, b"{}")
    client.close()


async def test_a_reply_released_before_its_end_closes_its_connection(serve: Serve) -> None:
    big = b"x" * (3 << 20)  # past the high-water mark: reading pauses until the caller reads
    server = await serve(lambda c, n, body: _ok(big))
    client = _client()
    reply = await client.post(server.url, {}, b"{}")
    assert await reply.read() == big
    reply.release()
    reply = await client.post(server.url, {}, b"{}")
    assert len(await anext(reply.chunks())) > 0
    reply.release()  # not read to the end: its connection is closed, not kept
    reply = await client.post(server.url, {}, b"{}")
    assert await reply.read() == big
    reply.release()
    assert server.connections == 2
    client.close()


async def test_a_header_with_a_line_break_is_refused(serve: Serve) -> None:
    server = await serve(lambda c, n, body: _ok(b"ok"))
    client = _client()
    with pytest.raises(ValueError, match="line break"):
        await client.post(server.url, {"x-id": "a\r\nInjected: yes"}, b"{}")
    assert server.requests == []
    client.close()


async def test_requests_are_written_in_the_order_they_were_posted(serve: Serve) -> None:
    """A request waiting for a new connection gets the first one given back, written at
    once: one posted after it cannot go out first on that freed connection."""
    server = await serve(lambda c, n, body: _ok(body))
    client = _client()
    first = await client.post(server.url, {}, b"r0")  # holds the only connection
    waiting = asyncio.create_task(client.post(server.url, {}, b"A"))
    await asyncio.sleep(0)  # A is in line; its connect has started
    assert await first.read() == b"r0"
    first.release()  # given to A, and A is written on it now
    later = asyncio.create_task(client.post(server.url, {}, b"B"))
    await asyncio.sleep(0)
    replies = [await waiting, await later]
    assert [await r.read() for r in replies] == [b"A", b"B"]
    for r in replies:
        r.release()
    assert [r.rsplit(b"\r\n\r\n", 1)[1] for r in server.requests] == [b"r0", b"A", b"B"]
    # B found no idle connection either: the connect A started served it, and B's own went
    # idle.
    assert server.connections == 3
    client.close()


async def test_a_failed_connect_fails_the_first_in_line(serve: Serve) -> None:
    client = _client()
    url = URL(f"http://127.0.0.1:{free_port()}/v1/completions")
    posts = [asyncio.create_task(client.post(url, {}, b"{}")) for _ in range(3)]
    for outcome in await asyncio.gather(*posts, return_exceptions=True):
        assert isinstance(outcome, BackendUnavailable)
    client.close()


async def test_a_request_that_goes_away_in_line_leaves_the_line(serve: Serve) -> None:
    server = await serve(lambda c, n, body: _ok(body))
    client = _client()
    first = await client.post(server.url, {}, b"r0")
    gone = asyncio.create_task(client.post(server.url, {}, b"gone"))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await first.read() == b"r0"
    first.release()
    reply = await client.post(server.url, {}, b"next")
    assert await reply.read() == b"next"
    reply.release()
    assert b"gone" not in b"".join(server.requests)
    client.close()


async def test_a_connection_given_back_broken_fails_the_request_in_line(serve: Serve) -> None:
    """The connection handed to the first request in line cannot be written (its sending
    side was shut): that request fails as unavailable, not the request that gave it back."""
    server = await serve(lambda c, n, body: _ok(body))
    client = _client()
    first = await client.post(server.url, {}, b"r0")
    waiting = asyncio.create_task(client.post(server.url, {}, b"A"))
    await asyncio.sleep(0)
    assert await first.read() == b"r0"
    conn = first._conn
    assert conn is not None
    assert conn.transport is not None
    conn.transport.write_eof()  # writing on it now raises
    first.release()  # the releasing side does not raise
    with pytest.raises(BackendUnavailable):
        await waiting
    client.close()


class _PacedConnects(Http1Client):
    """A client whose connects after the first wait for the test's word, and fail when told
    (the network's part, stood in for; the line's logic is the client's own)."""

    def __init__(self) -> None:
        super().__init__(connect_timeout_s=2.0, read_timeout_s=5.0)
        self.gates: list[tuple[asyncio.Event, list[bool]]] = []

    async def _connect(self, origin: tuple[str, str, int]) -> Any:
        if self.gates or getattr(self, "_first_done", False):
            gate: tuple[asyncio.Event, list[bool]] = (asyncio.Event(), [False])
            self.gates.append(gate)
            await gate[0].wait()
            if gate[1][0]:
                raise BackendUnavailable("refused")
        self._first_done = True
        return await super()._connect(origin)


async def test_a_failed_connect_spares_a_request_another_connect_will_serve(serve: Serve) -> None:
    """A's connect outlives A (a connection given back served it) and then fails: B, in line
    with its own connect still under way, is not failed for it."""
    server = await serve(lambda c, n, body: _ok(body))
    client = _PacedConnects()
    first = await client.post(server.url, {}, b"r0")
    a = asyncio.create_task(client.post(server.url, {}, b"A"))
    await asyncio.sleep(0)  # A in line, its connect (gate 0) waiting
    assert await first.read() == b"r0"
    first.release()  # served A
    reply_a = await a
    b = asyncio.create_task(client.post(server.url, {}, b"B"))
    await asyncio.sleep(0.01)  # B in line, its connect (gate 1) waiting
    assert len(client.gates) == 2
    client.gates[0][1][0] = True
    client.gates[0][0].set()  # A's connect fails
    await asyncio.sleep(0.01)
    assert not b.done()
    client.gates[1][0].set()  # B's connect goes through
    reply_b = await b
    assert await reply_b.read() == b"B"
    assert await reply_a.read() == b"A"
    reply_a.release()
    reply_b.release()
    client.close()


@pytest.mark.parametrize("pieces", [
    pytest.param([b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + b"x" * 4096],
                 id="length"),
    pytest.param([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                  *[b"400\r\n" + b"x" * 1024 + b"\r\n"] * 4, b"0\r\n\r\n"], id="chunked"),
    pytest.param([b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 4096, b"<close>"], id="until-close"),
])
async def test_a_whole_reply_past_the_limit_breaks_off(serve: Serve, pieces: list[bytes]) -> None:
    """A worker that never ends its reply must not fill the gateway's memory: read whole, a
    reply is at most ``max_reply_bytes``; a stream is relayed as it comes, whatever its
    length."""
    server = await serve(lambda c, n, body: pieces)
    small = Http1Client(1.0, 5.0, max_reply_bytes=4000)
    reply = await small.post(server.url, {}, b"{}")
    with pytest.raises(UpstreamBrokeOff, match="longer than 4000 bytes"):
        await reply.read()
    reply.release()
    big = Http1Client(1.0, 5.0, max_reply_bytes=4096)
    reply = await big.post(server.url, {}, b"{}")
    assert await reply.read() == b"x" * 4096
    reply.release()
    streamed = await small.post(server.url, {}, b"{}")
    assert b"".join([chunk async for chunk in streamed.chunks()]) == b"x" * 4096
    streamed.release()
    small.close()
    big.close()


async def test_a_request_after_close_is_unavailable_at_once(serve: Serve) -> None:
    """(It waited forever for a connection the closed client would never hand it.)"""
    server = await serve(lambda c, n, body: _ok(b"{}"))
    client = _client()
    client.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        await asyncio.wait_for(client.post(server.url, {}, b"{}"), 5)


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(200):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_connections_kept_warm_serve_requests_without_a_connect(serve: Serve) -> None:
    server = await serve(lambda c, n, body: _ok(b"%d" % c))  # answers its connection's number
    client = Http1Client(connect_timeout_s=2.0, read_timeout_s=5.0, idle_timeout_s=0.5)
    assert client.keep_warm(server.url, 2) == 2
    assert client.keep_warm(server.url, 2) == 0  # two on their way already
    await _until(lambda: client.idle(server.url) == 2)
    assert server.connections == 2
    replies = await asyncio.gather(*(client.post(server.url, {}, b"{}") for _ in range(2)))
    assert sorted([await reply.read() for reply in replies]) == [b"0", b"1"]
    for reply in replies:
        reply.release()
    assert server.connections == 2  # no connect on the requests' way
    await asyncio.sleep(0.6)  # both idle past the limit: closed here, and two new ones opened
    assert client.keep_warm(server.url, 2) == 2
    await _until(lambda: server.connections == 4)
    client.close()


async def test_a_worker_not_there_is_not_kept_warm_and_fails_no_request() -> None:
    client = _client()
    url = URL(f"http://127.0.0.1:{free_port()}/v1/completions")
    assert client.keep_warm(url, 1) == 1
    # The connect fails quietly, and the next call tries again.
    await _until(lambda: client.keep_warm(url, 1) == 1)
    assert client.idle(url) == 0
    with pytest.raises(BackendUnavailable):
        await client.post(url, {}, b"{}")
    client.close()
