"""The HTTP server around an application: aiohttp's, with its own errors in the OpenAI shape.

aiohttp answers requests it cannot parse (oversized or malformed headers, smuggling attempts
such as both ``Content-Length`` and ``Transfer-Encoding``, bad chunked framing) before any
application code runs, as plain text, and logs each with a traceback; a client that aborts its
upload is logged the same way. :class:`JsonErrorRunner` serves an application with a request
handler that renders those answers as ``{"error": {...}}`` JSON and logs them as one line
(tracebacks stay for real server errors). :func:`run` runs an application until SIGINT or
SIGTERM, like ``aiohttp.web.run_app``, on a TCP address plus any extra listening sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, Protocol, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.contracts.errors import openai_error
from gateway.contracts.lean_http import LEAN_ROUTES_KEY, LeanConnection, LeanRoutes

log = logging.getLogger(__name__)

_CLIENT_GONE = (ConnectionError, asyncio.IncompleteReadError)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "HTTP error"


SERVER_NAME_KEY = web.AppKey("server_name", str)


def name_server(app: web.Application, name: str) -> None:
    """Every response of ``app`` says ``Server: name``, where aiohttp would give its own and
    Python's versions (which help only someone looking for a known hole in them); so do the
    answers to requests that could not be parsed, when :func:`run` serves it."""
    app[SERVER_NAME_KEY] = name

    async def prepare(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = name

    app.on_response_prepare.append(prepare)


def error_body(status: int, message: str) -> bytes:
    """An OpenAI error body; ``code`` is the status phrase in snake case (``bad_request``)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = _phrase(status).lower().replace(" ", "_").replace("-", "_")
    return json.dumps(openai_error(message, kind, code=code)).encode()


class ConnectionCap:
    """At most ``limit`` client connections open at once (0: no cap): a flood of connections
    (slow or idle clients by the thousand) cannot take the file descriptors the process needs
    for its workers, its store and its clients' requests in flight.

    At the cap, a new connection takes the place of the oldest one that has no request in
    progress (idle between requests, or still sending a request's head: what a flood of
    connections is made of), which is closed (:meth:`JsonErrorServer.make_room`); only when
    every connection looked at has a request in progress is the new one answered 503 in the
    OpenAI shape and closed at once, before it is read. So connections held open without
    requests cannot keep new clients out, while no request in progress is cut off."""

    _WARN_EVERY_S = 10.0

    def __init__(self, limit: int, exempt_ports: frozenset[int] = frozenset()) -> None:
        if limit < 0:
            raise ValueError("the connection cap must be >= 0")
        self.limit = limit
        # Local ports whose connections are neither counted nor refused: the loopback admin
        # port, which an operator needs most when clients hold every other connection.
        self.exempt_ports = exempt_ports
        self.open = 0
        self.refused = 0
        self.evicted = 0  # connections without a request closed to make room for new ones
        self._warned_at = -self._WARN_EVERY_S
        self._refused_since_warning = 0

    def full(self) -> bool:
        return bool(self.limit) and self.open >= self.limit

    def take(self) -> bool:
        """Count one more connection, or say it is one too many (and count it refused)."""
        if self.full():
            self.refused += 1
            self._refused_since_warning += 1
            now = time.monotonic()
            if now - self._warned_at >= self._WARN_EVERY_S:
                log.warning("refused %d client connection(s): %d open, the cap "
                            "(--max-client-connections)", self._refused_since_warning,
                            self.open)
                self._warned_at, self._refused_since_warning = now, 0
            return False
        self.open += 1
        return True

    def give_back(self) -> None:
        self.open -= 1


def busy_answer(server_name: str | None) -> bytes:
    """The whole HTTP answer to a connection over the cap (then closed)."""
    body = error_body(503, "the server has too many connections open; retry shortly")
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n")
    if server_name:
        head += f"Server: {server_name}\r\n"
    return (head + "\r\n").encode("latin-1") + body


def client_connection_cap(configured: int, upstream_connections: int) -> int:
    """``configured``, or for 0 what the process's open files allow: its soft limit, raised
    to the hard one first (as network servers do), less the connections to workers
    (``upstream_connections``) and 256 for everything else, and at least 64."""
    if configured:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft - upstream_connections - 256)


class _Counted(Protocol):
    """A connection the cap counts: aiohttp's handler or a lean connection."""

    counted: bool

    def without_request(self) -> bool: ...
    def force_close(self) -> None: ...


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors as OpenAI-shaped JSON, and
    closing a connection over its server's :class:`ConnectionCap` as it opens."""

    counted = False  # whether its server's cap counts this connection
    # A connection handed over by the lean path (gateway.contracts.lean_http): whether the
    # cap counted it there (None: a connection of its own, admitted as it opens).
    adopted: bool | None = None

    def without_request(self) -> bool:
        """Whether no request is in progress here: the connection waits for a request's head
        (idle between requests, or still receiving one) with none queued."""
        waiter = getattr(self, "_waiter", None)
        return (waiter is not None and not waiter.done()
                and getattr(self, "_current_request", None) is None
                and not getattr(self, "_messages", None))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        if isinstance(manager, JsonErrorServer):
            if self.adopted is not None:  # its place under the cap goes with it
                if self.adopted:
                    self.counted = True
                    manager.counting(self)
            elif not manager.admit_counted(self, transport):
                self._manager = None  # never served: connection_lost has nothing to undo
                return
        super().connection_made(transport)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        remote = getattr(request, "remote", None) or "?"
        if isinstance(exc, _CLIENT_GONE) or _caused_by_client_gone(exc):
            log.info("client %s went away during its request: %s", remote,
                     type(exc).__name__ if exc is not None else "")
        elif status < 500:
            log.info("bad HTTP request from %s: %s", remote, _one_line(message or exc))
        else:
            self.log_exception("Error handling request from %s", remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        text = message if status < 500 and message else _phrase(status)
        resp = web.Response(status=status, body=error_body(status, _one_line(text)),
                            content_type="application/json")
        name = getattr(self._manager, "server_name", None)
        if name:
            resp.headers["Server"] = name
        resp.force_close()
        return resp


def _caused_by_client_gone(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, _CLIENT_GONE):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _one_line(value: object) -> str:
    text = str(value) if value is not None else ""
    return " ".join(text.split())[:300]


class JsonErrorServer(web.Server):
    # At the cap, how many of the oldest counted connections :meth:`make_room` looks at for
    # one without a request: a bound on the work per new connection.
    ROOM_SCAN = 64

    def __init__(self, *args: Any, cap: ConnectionCap | None = None,
                 server_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cap = cap if cap is not None else ConnectionCap(0)
        self.server_name = server_name  # the Server header of its own error answers
        # The connections the cap counts, oldest first (a dict keeps insertion order; one
        # found busy goes to the end, so the next scan does not look at it first again).
        self._counted: dict[_Counted, None] = {}
        # The lean path's routes (None: every connection is aiohttp's), from the app.
        self.lean: LeanRoutes | None = None
        self._idle_timeout_s = float(kwargs.get("keepalive_timeout", IDLE_TIMEOUT_S))

    def counting(self, handler: _Counted) -> None:
        self._counted[handler] = None

    def admit_counted(self, conn: _Counted, transport: asyncio.BaseTransport) -> bool:
        """Count a connection that just opened under the cap (making room first when it is
        full), or answer it 503 and close it (False). The loopback admin port's are not
        counted."""
        local = transport.get_extra_info("sockname")
        port = local[1] if isinstance(local, tuple) and len(local) > 1 else None
        if port in self.cap.exempt_ports:
            return True
        if self.cap.full():
            self.make_room()
        if not self.cap.take():
            cast(asyncio.Transport, transport).write(busy_answer(self.server_name))
            transport.close()
            return False
        conn.counted = True
        self.counting(conn)
        return True

    # -- the lean path's connections (gateway.contracts.lean_http.LeanServer) ------------------
    def admit(self, conn: Any, transport: asyncio.BaseTransport) -> bool:
        if not self.admit_counted(conn, transport):
            return False
        self._connections[conn] = cast(asyncio.Transport, transport)  # drained on shutdown
        return True

    def release(self, conn: Any) -> None:
        self._connections.pop(conn, None)
        if self._counted.pop(conn, 0) is None:
            conn.counted = False
            self.cap.give_back()

    def adopt(self, conn: Any, transport: asyncio.Transport) -> asyncio.Protocol:
        """aiohttp's connection handler for a lean connection handed over, which takes its
        place under the cap."""
        self._connections.pop(conn, None)
        counted = self._counted.pop(conn, 0) is None
        handler = JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.adopted = counted
        handler.connection_made(transport)
        return handler

    def make_room(self) -> bool:
        """Close the oldest counted connection without a request in progress, among the
        ``ROOM_SCAN`` oldest, and give its place back to the cap; False when there is none."""
        busy = []
        found = None
        for handler in self._counted:
            if handler.without_request():
                found = handler
                break
            busy.append(handler)
            if len(busy) >= self.ROOM_SCAN:
                break
        for handler in busy:  # looked at and busy: to the end of the line
            del self._counted[handler]
            self._counted[handler] = None
        if found is None:
            return False
        del self._counted[found]
        found.counted = False
        found.force_close()
        self.cap.give_back()
        self.cap.evicted += 1
        return True

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.lean is not None:
            return LeanConnection(self, self.lean, self._idle_timeout_s)
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if isinstance(handler, JsonErrorRequestHandler) and handler.counted:
            handler.counted = False
            self._counted.pop(handler, None)
            self.cap.give_back()


# Seconds a client connection may stay idle, or take to send a request's head (aiohttp's
# own default for an AppRunner is 3,630: an hour in which a client sending a header a minute
# holds a connection, and a few thousand such clients every file descriptor of the process).
IDLE_TIMEOUT_S = 75.0


class JsonErrorRunner(web.AppRunner):
    """An ``AppRunner`` whose connections use :class:`JsonErrorRequestHandler`, and whose
    handlers are cancelled when their client disconnects (``handler_cancellation``; aiohttp's
    default lets them run on): a request waiting on a worker then closes its upstream
    connection at once, which the worker sees as its own client going away. A connection
    that sends no complete request head within ``idle_timeout_s`` of connecting, or of the
    end of its last answer, is closed (aiohttp's keep-alive timer, which runs while a
    connection waits for a head)."""

    def __init__(self, app: web.Application, *, handler_cancellation: bool = True,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, cap: ConnectionCap | None = None,
                 **kwargs: Any) -> None:
        super().__init__(app, handler_cancellation=handler_cancellation,
                         keepalive_timeout=idle_timeout_s, **kwargs)
        self._cap = cap if cap is not None else ConnectionCap(0)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        server = JsonErrorServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            cap=self._cap,
            server_name=self._app.get(SERVER_NAME_KEY),
            **plain._kwargs,
        )
        server.lean = self._app.get(LEAN_ROUTES_KEY)
        return server


async def _serve(
    app: web.Application,
    host: str,
    port: int,
    extra_sockets: Sequence[socket.socket],
    shutdown_timeout_s: float,
    on_ready: Callable[[], None],
    reuse_port: bool | None,
    backlog: int,
    idle_timeout_s: float,
    cap: ConnectionCap,
    ssl_context: ssl.SSLContext | None,
) -> None:
    # The extra sockets (the loopback admin port) stay reachable however many clients connect.
    cap.exempt_ports = frozenset(s.getsockname()[1] for s in extra_sockets)
    runner = JsonErrorRunner(app, access_log=None, handle_signals=True,
                             shutdown_timeout=shutdown_timeout_s, idle_timeout_s=idle_timeout_s,
                             cap=cap)
    try:
        await runner.setup()  # a resource failing to start: the ones started are closed below
        await web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=backlog,
                          ssl_context=ssl_context).start()
        for sock in extra_sockets:
            await web.SockSite(runner, sock).start()
        on_ready()
        await asyncio.Event().wait()  # until SIGINT/SIGTERM raise GracefulExit
    finally:
        await runner.cleanup()


def run(
    app: web.Application,
    *,
    host: str,
    port: int,
    extra_sockets: Sequence[socket.socket] = (),
    shutdown_timeout_s: float = 30.0,
    on_ready: Callable[[], None] = lambda: None,
    reuse_port: bool | None = None,
    backlog: int = 128,
    loop: asyncio.AbstractEventLoop | None = None,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    cap: ConnectionCap | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve ``app`` on ``loop`` (a new one by default) until SIGINT or SIGTERM, then drain
    in-flight requests (up to ``shutdown_timeout_s``) and run its cleanup. Connections idle
    for ``idle_timeout_s``, or that take longer to send a request's head, are closed; past
    ``cap`` (none by default), one is answered 503 and closed. With ``ssl_context`` the TCP
    address speaks TLS (the extra sockets do not)."""
    if loop is None:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(_serve(app, host, port, extra_sockets, shutdown_timeout_s, on_ready,
                                   reuse_port, backlog, idle_timeout_s,
                                   cap if cap is not None else ConnectionCap(0), ssl_context))
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        task.cancel()  # its cleanup drains in-flight requests, then closes resources
        with contextlib.suppress(asyncio.CancelledError, web.GracefulExit, KeyboardInterrupt):
            loop.run_until_complete(task)
        rest = asyncio.all_tasks(loop)
        for other in rest:
            other.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
