"""A lean HTTP/1.1 path for the relay's plain requests, beside aiohttp's server.

aiohttp's server builds, for every request, a request object (its header mapping, URL, body
stream, task and writer) and, for every answer, a response object prepared and written through
its writer: about an eighth of the gateway's CPU per relayed request, measured against this
path (BENCHMARKS.md, "a lean path for the plain relay requests"). :class:`LeanConnection` serves
itself the requests that make up the relay's traffic, and only those: a route of
:attr:`LeanRoutes.handlers` (the completions ``POST``s, and the ``GET``s of the probes and
views clients send on the same connections), HTTP/1.1, a head of plain header lines, for a
``POST`` a ``Content-Length`` body of at most :attr:`LeanRoutes.max_body` bytes, whole in the
bytes read with its head, that does not ask for a stream. Its request object
(:class:`LeanRequest`) carries what those handlers read of a request; the answer, a whole one,
is written as bytes.

Anything else on a connection, from its first byte on (another method or path, a chunked or
oversized body or one still arriving, ``Expect``, ``Upgrade``, an ``Origin``, a malformed or
oversized head, a stream), hands the whole connection, with the bytes read so far, to aiohttp's
connection handler for good (:meth:`LeanConnection.hand_off`). Its parser, limits, timeouts
and error answers stay the server's for all input this path does not take: it accepts a strict
subset of HTTP/1.1 and decides nothing about the rest. A body still arriving goes over too, so
that what refuses a request unread (its tenant's limits, the body budget) does so before the
body is read, and the body timeout runs.

A connection counts under the server's connection cap from its first byte, like aiohttp's
(:class:`gateway.contracts.httpserver.JsonErrorServer`), and keeps its place when handed over.
It is closed once it has waited the idle timeout for a request's head, and drained on shutdown
like aiohttp's: the request in progress finishes within the shutdown timeout. A client that
goes away cancels its request's handler, as the gateway's runner has aiohttp do
(``handler_cancellation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol, cast

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

_MAX_HEAD = 8190  # aiohttp's own limit on a line; a longer head goes to aiohttp's parser
_MAX_FIELDS = 100
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Request headers the lean path leaves to aiohttp (their semantics are aiohttp's to apply).
_LEFT_TO_AIOHTTP = frozenset({"transfer-encoding", "expect", "upgrade", "origin",
                              "content-encoding"})
_REASONS = {s.value: s.phrase for s in HTTPStatus}
# Answer headers this path writes itself.
_SET_HERE = frozenset({"content-length", "date", "connection", "transfer-encoding"})
# A body that may ask for a stream: the key "stream" set to true anywhere in it (a quote inside
# a JSON string is escaped, so this is a key; a nested one only sends a request to aiohttp).
_ASKS_STREAM = re.compile(rb'"stream"\s*:\s*true')


class _DateHeader:
    """The ``Date`` header's value, made once a second."""

    __slots__ = ("_at", "_value")

    def __init__(self) -> None:
        self._at = -1
        self._value = ""

    def now(self) -> str:
        second = int(time.time())
        if second != self._at:
            self._at, self._value = second, formatdate(second, usegmt=True)
        return self._value


@dataclass(frozen=True, slots=True)
class LeanRoutes:
    """What the lean path serves: (method, request target) -> (method, path, handler),
    through ``middleware`` (the application's one middleware), for bodies of at most
    ``max_body`` bytes (a ``GET``: none)."""

    app: web.Application
    handlers: Mapping[tuple[bytes, bytes], tuple[str, str, Handler]]
    middleware: Middleware
    max_body: int = 1 << 16
    date: _DateHeader = field(default_factory=_DateHeader)  # the answers' Date header


LEAN_ROUTES_KEY = web.AppKey("lean_routes", LeanRoutes)


class LeanServer(Protocol):
    """What a lean connection needs of its server (JsonErrorServer)."""

    def admit(self, conn: Any, transport: asyncio.BaseTransport) -> bool: ...
    def release(self, conn: Any) -> None: ...
    def adopt(self, conn: Any, transport: asyncio.Transport) -> asyncio.Protocol: ...


class _Body:
    """A whole request body, read the way the gateway reads aiohttp's (``request.content``)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def is_eof(self) -> bool:
        return True

    def read_nowait(self) -> bytes:
        return self._data


class LeanRequest(dict[Any, Any]):
    """The part of ``web.Request`` the gateway's relay handlers and middleware read: the app,
    method, path, headers, declared length, body, transport and peer, and per-request values by
    key (the request's record, the caller's identity). Nothing else is there: a handler that
    read more would fail its tests on this path."""

    __slots__ = ("app", "connection", "content", "content_length", "headers", "method", "path",
                 "remote", "transport")

    def __init__(self, app: web.Application, method: str, path: str,
                 headers: CIMultiDictProxy[str], body: bytes, transport: asyncio.Transport,
                 connection: LeanConnection) -> None:
        super().__init__()
        self.app = app
        self.method = method
        self.path = path
        self.headers = headers
        self.content_length = len(body)
        self.content = _Body(body)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) and peer else None
        self.connection = connection


def lean_connection_of(request: web.Request) -> LeanConnection | None:
    """The lean connection a request came in on (None: aiohttp's)."""
    conn = getattr(request, "connection", None)
    return conn if isinstance(conn, LeanConnection) else None




class LeanConnection(asyncio.Protocol):
    """One client connection on the lean path (module docstring)."""

    def __init__(self, server: LeanServer, routes: LeanRoutes, idle_timeout_s: float) -> None:
        self._server = server
        self._routes = routes
        self._idle_timeout_s = idle_timeout_s
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._task: asyncio.Task[None] | None = None  # the request in progress
        self._closing = False  # shutting down: no further request is read
        self._last = 0.0  # when the connection last finished a request (or opened)
        self._timer: asyncio.TimerHandle | None = None
        self._writing = True  # False while the transport's buffer is over its high mark
        self._drained: asyncio.Future[None] | None = None
        self.counted = False  # whether the server's connection cap counts it

    # -- the server's view (JsonErrorServer) ---------------------------------------------------
    def without_request(self) -> bool:
        """No request in progress: waiting for, or still reading, a request's head."""
        return self._task is None

    def force_close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        """Stop after the request in progress (now, when there is none)."""
        self._closing = True
        if self._task is None:
            self.force_close()

    async def shutdown(self, timeout: float | None = 15.0) -> None:  # noqa: ASYNC109 (aiohttp calls it so)
        """Let the request in progress finish within ``timeout``, then close."""
        self._closing = True
        task = self._task
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(task)
            if not task.done():
                task.cancel()
        self.force_close()

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._server.admit(self, transport):
            return
        self._transport = cast(asyncio.Transport, transport)
        self._last = self._loop.time()
        self._timer = self._loop.call_at(self._last + self._idle_timeout_s, self._check_time)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()  # the client went away: its request's handler stops
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))
        self._server.release(self)

    def pause_writing(self) -> None:
        self._writing = False

    def resume_writing(self) -> None:
        self._writing = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:  # refused at the cap, or closed
            return
        self._buf += data
        if self._task is None and not self._closing:
            self._read_next()
        elif len(self._buf) > self._routes.max_body + _MAX_HEAD:
            # Requests pipelined behind the one in progress: read on once it is answered.
            self._transport.pause_reading()

    # -- reading requests ----------------------------------------------------------------------
    def _read_next(self) -> None:
        try:
            self._next()
        except Exception:  # a bug of this path: aiohttp's server takes the connection
            log.exception("the lean HTTP path failed to read a request; handed to aiohttp")
            self.hand_off()

    def _next(self) -> None:
        """Serve the next request in the buffer, or hand the connection over, or wait."""
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self.hand_off()
            return
        if end > _MAX_HEAD:
            self.hand_off()
            return
        parsed = self._parse_head(bytes(buf[:end]))
        if parsed is None:
            self.hand_off()
            return
        method, path, handler, headers, length, close = parsed
        if length > self._routes.max_body:
            self.hand_off()
            return
        start = end + 4
        if len(buf) < start + length:
            # The body is still coming: aiohttp's handler takes the request, so that what
            # refuses it unread (its tenant's limits, the body budget) does so before it is
            # read, and its body timeout runs.
            self.hand_off()
            return
        body = bytes(buf[start:start + length])
        if b'"stream"' in body and _ASKS_STREAM.search(body):  # aiohttp's writer relays those
            self.hand_off()
            return
        del buf[:start + length]
        transport = self._transport
        assert transport is not None
        request = LeanRequest(self._routes.app, method, path, headers, body, transport, self)
        if close:
            self._closing = True
        self._task = self._loop.create_task(self._serve(request, handler))

    def _parse_head(
        self, head: bytes
    ) -> tuple[str, str, Handler, CIMultiDictProxy[str], int, bool] | None:
        """The request's method, path, handler, headers, body length and whether the client
        closes after it; None for a request the lean path leaves to aiohttp."""
        lines = head.split(b"\r\n")
        first = lines[0].split(b" ")
        if len(first) != 3 or first[2] != b"HTTP/1.1":
            return None
        route = self._routes.handlers.get((first[0], first[1]))
        if route is None or len(lines) > _MAX_FIELDS:
            return None
        headers: CIMultiDict[str] = CIMultiDict()
        length = -1
        close = False
        for line in lines[1:]:
            name, sep, raw = line.partition(b":")
            if not sep or not name or not _TOKEN.issuperset(name):
                return None  # obs-fold, spaces in a name, a line without a colon
            value = raw.strip(b" \t")
            if b"\r" in value or b"\n" in value or b"\x00" in value:
                return None
            text, lowered = value.decode("latin-1"), name.decode("ascii").lower()
            if lowered == "content-length":
                if length >= 0 or not value.isdigit() or len(value) > 12:
                    return None
                length = int(value)
            elif lowered in _LEFT_TO_AIOHTTP:
                return None
            elif lowered == "connection":
                close = "close" in text.lower()
            headers.add(name.decode("ascii"), text)
        if route[0] == "GET":
            if length > 0:  # a GET with a body: aiohttp's to judge
                return None
            length = 0
        elif length < 0:
            return None
        return route[0], route[1], route[2], CIMultiDictProxy(headers), length, close

    def hand_off(self) -> None:
        """Give the connection, with what it read, to aiohttp's connection handler for good."""
        transport = self._transport
        if transport is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        data, self._buf = bytes(self._buf), bytearray()
        handler = self._server.adopt(self, transport)
        transport.set_protocol(handler)
        if data:
            handler.data_received(data)

    def _check_time(self) -> None:
        """The connection's one timer: it closes the connection once it has waited the idle
        timeout for a request's head, and is otherwise armed again for the next deadline (a
        request in progress starts the idle clock anew when it ends)."""
        self._timer = None
        if self._transport is None:
            return
        now = self._loop.time()
        if self._task is None and now >= self._last + self._idle_timeout_s:
            self.force_close()
            return
        start = now if self._task is not None else self._last
        due = start + self._idle_timeout_s
        self._timer = self._loop.call_at(max(due, now + 0.05), self._check_time)

    # -- serving -------------------------------------------------------------------------------
    async def _serve(self, request: LeanRequest, handler: Handler) -> None:
        try:
            # The relay handlers read only what LeanRequest carries (its docstring).
            await self._routes.middleware(cast(web.Request, request), handler)
        except (asyncio.CancelledError, ConnectionResetError):
            self._closing = True  # the client went away (or shutdown cancelled it)
        except Exception:  # the middleware answers every error: this is a bug of its own
            log.exception("the lean HTTP path failed to serve %s", request.path)
            self._closing = True
        finally:
            self._task = None
            self._last = self._loop.time()
            if self._closing:
                self.force_close()
            elif self._transport is not None:
                if not self._transport.is_reading():
                    self._transport.resume_reading()
                if self._buf:
                    self._read_next()

    async def respond(self, request: web.Request, response: web.StreamResponse) -> None:
        """Write a whole ``response`` to ``request`` (the middleware's answer), after the
        application's ``on_response_prepare`` hooks, as aiohttp would prepare it."""
        await self._routes.app.on_response_prepare.send(request, response)
        body = response.body if isinstance(response, web.Response) else b""
        if not isinstance(body, bytes | bytearray):
            raise TypeError("the lean path writes whole bodies of bytes only")
        close = self._closing or response.keep_alive is False
        self._write_whole(response.status, response.headers, bytes(body), close=close)
        if not self._writing and self._transport is not None:
            self._drained = self._loop.create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    def _write_whole(self, status: int, headers: Mapping[str, str], body: bytes,
                     close: bool = False) -> None:
        transport = self._transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        fields = [f"{name}: {value}\r\n" for name, value in headers.items()
                  if name.lower() not in _SET_HERE]
        text = "".join(fields)
        if text.count("\n") != len(fields) or text.count("\r") != len(fields):  # refused, as
            raise ValueError("a response header holds a line break")  # aiohttp does too
        if close:
            self._closing = True
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n{text}"
                f"Content-Length: {len(body)}\r\nDate: {self._routes.date.now()}\r\n"
                + ("Connection: close\r\n\r\n" if close else "\r\n"))
        transport.write(head.encode("latin-1") + body)
