"""Floors for a Python router: bare relays (uvloop when installed), one per server and client.

``python -m loadtest.floor_proxy --port P --worker URL [--worker URL ...] [--client C]
[--server S]`` relays each completion request's bytes to the next worker in turn and its reply
back: no parsing, no routing, no telemetry, no limits. The parts can be chosen, so that a
benchmark shows what each costs on its own:

* ``--server aiohttp`` (the default): aiohttp's web server, as the gateway's;
  ``--server protocol``: a bare ``asyncio.Protocol`` that reads a request line, headers and a
  ``Content-Length`` body, and writes one reply per request (keep-alive, requests on one
  connection in turn). It answers nothing else: no chunked bodies, no limits, no errors.
  ``--server lowlevel``: aiohttp's low-level server (its connection handler and parser, no
  application: no router, middlewares or signals); ``--server objects``: the bare protocol's
  parse, then aiohttp's request, response and writer objects for each request (what a server
  of the gateway's own would cost if its handlers kept aiohttp's objects).
* ``--client aiohttp`` (the default): aiohttp's client session; ``--client http1``: the
  gateway's relay client (:mod:`gateway.backends.http1`).

``loadtest.bench_overhead --routers ...,floor,floor-h1,floor-low,floor-objects,floor-lean``
runs them beside our gateway and the Rust routers. Benchmark baselines, not products: none has
the gateway's safety.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
from aiohttp import HttpVersion11, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.backends.http1 import Http1Client

SESSION = web.AppKey("session", aiohttp.ClientSession)
RELAY_CLIENT = web.AppKey("relay_client", Http1Client)
CLIENTS = ("aiohttp", "http1")
SERVERS = ("aiohttp", "lowlevel", "protocol", "objects")
_JSON = {"Content-Type": "application/json"}
_TIMEOUTS = (5.0, 300.0)  # connect, read (seconds)

# A relay: (path, body) -> (status, reply body).
Relay = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]


def _turns(workers: Sequence[str]) -> Callable[[], str]:
    turn = itertools.cycle([w.rstrip("/") for w in workers])
    return lambda: next(turn)


def aiohttp_relay(session: aiohttp.ClientSession, workers: Sequence[str]) -> Relay:
    next_worker = _turns(workers)

    async def relay(path: str, body: bytes) -> tuple[int, bytes]:
        async with session.post(next_worker() + path, data=body, headers=_JSON) as reply:
            return reply.status, await reply.read()

    return relay


def http1_relay(client: Http1Client, workers: Sequence[str]) -> Relay:
    next_worker = _turns(workers)

    async def relay(path: str, body: bytes) -> tuple[int, bytes]:
        reply = await client.post(URL(next_worker() + path), _JSON, body)
        try:
            return reply.status, await reply.read()
        finally:
            reply.release()

    return relay


def build_app(workers: Sequence[str], client: str = "aiohttp") -> web.Application:
    """aiohttp's server relaying through ``client`` (one of :data:`CLIENTS`)."""
    relays: list[Relay] = []

    async def relay(request: web.Request) -> web.Response:
        status, payload = await relays[0](request.path, await request.read())
        return web.Response(body=payload, status=status, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session(app: web.Application) -> AsyncIterator[None]:
        if client == "http1":
            app[RELAY_CLIENT] = Http1Client(*_TIMEOUTS)
            relays.append(http1_relay(app[RELAY_CLIENT], workers))
            yield
            app[RELAY_CLIENT].close()
            return
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        relays.append(aiohttp_relay(app[SESSION], workers))
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    return app


class BareHTTP(asyncio.Protocol):
    """The least a relay's server does per request: find the head's end, read
    ``Content-Length``, gather the body, write one reply. Requests on one connection are
    served in turn. Anything else (chunked bodies, oversized heads, bad framing) closes the
    connection."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()  # bytes not yet taken by a request
        self._head: tuple[bytes, str, list[bytes]] | None = None  # method, path, header lines
        self._body: list[bytes] = []  # the body's pieces so far
        self._missing = 0  # body bytes still to come
        self._busy = False
        self._task: asyncio.Task[None] | None = None  # the request being served (kept alive)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        if self._head is not None and not self._busy and not self._buffer:
            self._take(data)  # the body of the request in hand: no copy into the buffer
            return
        self._buffer += data
        if not self._busy:
            self._next()

    def _take(self, data: bytes) -> None:
        piece, rest = data[:self._missing], data[self._missing:]
        self._body.append(piece)
        self._missing -= len(piece)
        if rest:
            self._buffer += rest
        if not self._missing:
            self._start()

    def _next(self) -> None:
        if self._head is None:
            buffer = self._buffer
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > 65536:
                    self._close()
                return
            lines = bytes(buffer[:end]).split(b"\r\n")
            parts = lines[0].split(b" ")
            if len(parts) != 3:
                self._close()
                return
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    if not value.strip().isdigit():
                        self._close()
                        return
                    length = int(value)
                elif name == b"transfer-encoding":
                    self._close()
                    return
            del buffer[:end + 4]
            self._head = (parts[0], parts[1].decode("latin-1"), lines[1:])
            self._body, self._missing = [], length
        if self._buffer:
            data, self._buffer = bytes(self._buffer), bytearray()
            self._take(data)
        elif not self._missing:
            self._start()

    def _start(self) -> None:
        head, self._head = self._head, None
        assert head is not None
        body = b"".join(self._body)
        self._body = []
        self._busy = True
        self._task = asyncio.get_running_loop().create_task(
            self._serve(head[0], head[1], head[2], body))

    async def _answer(self, method: bytes, path: str, body: bytes) -> tuple[int, bytes]:
        """The status and body for a request: a completion relayed, the health check, or 404."""
        if method == b"POST" and path in ("/v1/chat/completions", "/v1/completions"):
            try:
                return await self._relay(path, body)
            except Exception:  # a benchmark baseline: the worker failed, the client sees 502
                return 502, b'{"error": "upstream"}'
        if method == b"GET" and path == "/health":
            return 200, b"ok"
        return 404, b"{}"

    async def _serve(self, method: bytes, path: str, fields: list[bytes], body: bytes) -> None:
        status, payload = await self._answer(method, path, body)
        if self._transport is None:
            return
        self._transport.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (status, len(payload)) + payload)
        self._done()

    def _done(self) -> None:
        """The request in hand is answered: the next one on the connection, if it came."""
        self._busy = False
        if self._buffer:
            self._next()

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class ObjectsHTTP(BareHTTP):
    """:class:`BareHTTP`'s parse, then per request what aiohttp's server builds: the header
    mapping, the request (its body in a ``StreamReader``), a ``StreamWriter`` and a
    ``web.Response`` prepared and written through them. Set beside ``floor-lean`` and
    ``floor-low``, it splits aiohttp's cost per request between its connection handling and
    parser and its request and response objects."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(relay)
        self._writing = BaseProtocol(asyncio.get_running_loop())  # the writer's flow control
        # What ``web.BaseRequest`` reads from its protocol.
        self.ssl_context = None
        self.peername: object = None
        self.sockname: object = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._writing.connection_made(transport)
        self.peername = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._writing.connection_lost(exc)

    def pause_writing(self) -> None:
        self._writing.pause_writing()

    def resume_writing(self) -> None:
        self._writing.resume_writing()

    async def _serve(self, method: bytes, path: str, fields: list[bytes], body: bytes) -> None:
        loop = asyncio.get_running_loop()
        raw = tuple((name.strip(), value.strip())
                    for name, _, value in (f.partition(b":") for f in fields))
        headers = CIMultiDictProxy(CIMultiDict(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in raw))
        message = RawRequestMessage(method.decode("latin-1"), path, HttpVersion11, headers, raw,
                                    False, None, False, False, URL.build(path=path, encoded=True))
        payload = StreamReader(self._writing, len(body) + 1, loop=loop)  # all in hand
        payload.feed_data(body)
        payload.feed_eof()
        task = asyncio.current_task()
        assert task is not None
        request = web.BaseRequest(message, payload, self,  # type: ignore[arg-type]
                                  StreamWriter(self._writing, loop), task, loop)
        status, reply = await self._answer(method, request.path, await request.read())
        if self._transport is None:
            return
        response = web.Response(body=reply, status=status, content_type="application/json")
        await response.prepare(request)
        await response.write_eof()
        self._done()


async def serve_lowlevel(host: str, port: int, workers: Sequence[str]) -> None:
    """aiohttp's low-level server (its connection handler and request parser, no
    application: no router, middlewares or signals) relaying through the gateway's client."""
    client = Http1Client(*_TIMEOUTS)
    relay = http1_relay(client, workers)

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST" and request.path in ("/v1/chat/completions",
                                                         "/v1/completions"):
            status, payload = await relay(request.path, await request.read())
            return web.Response(body=payload, status=status, content_type="application/json")
        if request.method == "GET" and request.path == "/health":
            return web.Response(text="ok")
        return web.Response(status=404, body=b"{}", content_type="application/json")

    server = await asyncio.get_running_loop().create_server(
        web.Server(handler, access_log=None), host, port, reuse_address=True)
    try:
        async with server:
            await server.serve_forever()
    finally:
        client.close()


async def serve_bare(host: str, port: int, workers: Sequence[str],
                     kind: type[BareHTTP] = BareHTTP) -> None:
    """``kind`` (:class:`BareHTTP` or :class:`ObjectsHTTP`) relaying through the gateway's
    client, until cancelled."""
    client = Http1Client(*_TIMEOUTS)
    relay = http1_relay(client, workers)
    server = await asyncio.get_running_loop().create_server(
        lambda: kind(relay), host, port, reuse_address=True)
    try:
        async with server:
            await server.serve_forever()
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.floor_proxy", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", action="append", required=True)
    p.add_argument("--client", choices=CLIENTS, default="aiohttp")
    p.add_argument("--server", choices=SERVERS, default="aiohttp")
    args = p.parse_args(argv)
    if args.server != "aiohttp" and args.client != "http1":
        p.error(f"--server {args.server} relays through --client http1")
    try:
        loop: asyncio.AbstractEventLoop = importlib.import_module("uvloop").new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    if args.server != "aiohttp":
        asyncio.set_event_loop(loop)
        serving = (serve_lowlevel(args.host, args.port, args.worker)
                   if args.server == "lowlevel" else
                   serve_bare(args.host, args.port, args.worker,
                              ObjectsHTTP if args.server == "objects" else BareHTTP))
        try:
            loop.run_until_complete(serving)
        except KeyboardInterrupt:
            pass
        finally:
            loop.close()
        return
    web.run_app(build_app(args.worker, args.client), host=args.host, port=args.port,
                access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
