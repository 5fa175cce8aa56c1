"""A lean HTTP/1.1 client for the relay path: one write per request, one parser per connection.

Relaying a completion is the gateway's hottest path, and a general-purpose client does far more
per call than a relay needs (request and response objects with dozens of fields, tracing hooks,
cookie and redirect handling, a connector with waiters per host). This client does only what
relaying a POST to a known worker takes:

* **Connections** are kept alive per origin (scheme, host, port) and reused most recent first.
  One idle longer than ``idle_timeout_s`` is closed instead of reused (servers close idle
  connections after a few seconds: uvicorn after 5 s, so the default is 4 s). The number of
  connections in use is bounded by the caller (:class:`gateway.guard.ConnectionSlots`).
  :meth:`Http1Client.keep_warm` opens some ahead of any request (the OpenAI backend does at
  each healthy probe), so that a burst after quiet finds them.
* **Requests to one origin are written in the order they were posted.** With no idle
  connection a request starts a connect and waits in line; whichever comes first, a connection
  given back or a connect finished (its own or an earlier request's), is the first waiting
  request's, and its bytes are written there at once, before any later request can run. A
  worker with a prefix cache must see turn N of a session before turn N+1, which the router
  predicted to find turn N's blocks cached; a connect takes several turns of a busy event
  loop, and a request posted meanwhile would otherwise go out first on a freed connection.
* **A request** is one vectored write: the head (request line, ``Host``, ``Content-Length``,
  the given headers) and the body bytes as they are.
* **A reply** is parsed as it arrives by :class:`_Connection` (status line and headers; a body
  framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection;
  interim 1xx heads skipped) and handed out chunk by chunk (:class:`Http1Reply`). Reading pauses
  while more than ``_HIGH_WATER`` bytes wait for the caller.
* **Timeouts**: ``connect_timeout_s`` to connect, ``read_timeout_s`` between bytes of the reply
  (a timer is armed only while the caller waits for bytes that are not there yet).
* **A reused connection the server closed meanwhile** (it found it idle, as the request went
  out) fails before any byte of a reply: the request is sent once more on a new connection, as
  other HTTP clients do. Any other failure before the reply raises
  :class:`~gateway.backends.base.BackendUnavailable`; a failure in the middle of the body
  raises :class:`~gateway.backends.base.UpstreamBrokeOff`.

The health probes use a client of their own of this kind (three ``GET``s per worker each
interval, ``Content-Length`` left out); admin calls, rare and not relays, keep aiohttp's.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, cast

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.backends.base import BackendUnavailable, UpstreamBrokeOff

_MAX_HEAD = 64 * 1024  # bytes of one response head (status line and headers)
_HIGH_WATER = 1 << 20  # body bytes waiting for the caller before reading pauses
_LOW_WATER = 1 << 18  # ... and below which it resumes
_NO_BODY = frozenset({204, 304})
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def _is_digits(text: str) -> bool:
    """Whether ``text`` is ASCII digits only (``str.isdigit`` also takes other scripts' digits
    and superscripts, which ``int`` then refuses or reads)."""
    return text.isascii() and text.isdigit()

# Body framings.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = 0, 1, 2
# Chunked decoder states.
_SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class _Connection(asyncio.Protocol):
    """One connection to a worker and the parser of the reply it is receiving."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        # The read timeout: one timer per connection, re-armed lazily (see _watch), over the
        # wait it watches (the reply's head, or its next body bytes).
        self._read_timer: asyncio.TimerHandle | None = None
        self._timed: asyncio.Future[None] | None = None
        self._wait_since = 0.0
        self._wait_limit = 0.0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())  # the last reply's
        self._reset()

    def _reset(self) -> None:
        """Ready for the next exchange on this connection."""
        self._buf = bytearray()  # unparsed bytes: the head so far, or a chunked control line
        self.in_head = True
        self.received = False  # any byte of this exchange's reply
        self.status = 0
        self._framing = _LENGTH
        self._left = 0  # body bytes (or chunk bytes) still to come
        self._chunk_state = _SIZE
        self.chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self.done = False  # the whole reply arrived
        self.error: BaseException | None = None
        self.keep_alive = True

    # -- the exchange, as the client drives it ---------------------------------------------------

    def send(self, head: bytes, body: bytes) -> asyncio.Future[None]:
        """Write one request; the future resolves once the reply's head is parsed."""
        assert self.transport is not None
        self._reset()
        self.transport.writelines((head, body))  # raises before any waiter exists
        waiter = self._head_waiter = self._loop.create_future()
        return waiter

    async def wait_head(self, waiter: asyncio.Future[None], timeout_s: float | None) -> None:
        """Until the head of the reply to the request :meth:`send` wrote (``waiter``, what it
        returned) is in (``TimeoutError`` after ``timeout_s`` without it)."""
        self._watch(waiter, timeout_s)
        await waiter

    async def wait_body(self, timeout_s: float | None) -> None:
        """Until more body bytes, the end of the reply, or an error are there (``TimeoutError``
        after ``timeout_s`` without any)."""
        waiter = self._body_waiter = self._loop.create_future()
        self._watch(waiter, timeout_s)
        try:
            await waiter
        finally:
            self._body_waiter = None

    def _watch(self, waiter: asyncio.Future[None], timeout_s: float | None) -> None:
        """``waiter`` fails with ``TimeoutError`` if it is not done within ``timeout_s``. A
        request waits once for its head and a stream once per chunk, so this is not a timer per
        wait (on uvloop a timer made and cancelled costs microseconds, a request's every
        wait): the wait notes when it began, and the connection's one timer, armed when none
        is, re-arms itself for the current wait's deadline if it fires early."""
        self._timed = waiter
        self._wait_limit = timeout_s or 0.0
        if timeout_s:
            self._wait_since = self._loop.time()
            if self._read_timer is None:
                self._read_timer = self._loop.call_at(self._wait_since + timeout_s,
                                                      self._read_due)

    def _read_due(self) -> None:
        self._read_timer = None
        waiter = self._timed
        if waiter is None or waiter.done() or not self._wait_limit:
            return  # not waiting: the next wait arms the timer again
        due = self._wait_since + self._wait_limit
        if self._loop.time() < due:
            self._read_timer = self._loop.call_at(due, self._read_due)
        else:
            waiter.set_exception(TimeoutError())

    def take(self) -> bytes:
        """Every body byte received and not taken yet (at least one chunk's), in one piece:
        a relay that fell behind catches up with one write, not one per chunk."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._buffered <= _LOW_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def _stop_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        why = f": {exc}" if exc else ""
        if self.in_head:
            when = "while sending" if self.received else "before"
            self._fail_head(ConnectionResetError(
                f"the worker closed the connection {when} its reply{why}"))
        elif not self.done:
            if self._framing == _UNTIL_CLOSE and exc is None:
                self._finish()
            else:
                self._fail_body(UpstreamBrokeOff(
                    f"the connection closed before the end of the reply{why}"))

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            if self.in_head:
                self._buf += data
                if not self._parse_head():
                    return
                data, self._buf = bytes(self._buf), bytearray()
            if data:
                self._parse_body(data)
        except _BadReply as exc:
            self.keep_alive = False
            if self.in_head:
                self._fail_head(exc)
            else:
                self._fail_body(UpstreamBrokeOff(str(exc)))
            if self.transport is not None:
                self.transport.close()

    # -- parsing -------------------------------------------------------------------------------

    def _parse_head(self) -> bool:
        """Parse the head once it is all there; True when the body may start."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise _BadReply("the reply's head is too large")
                return False
            lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
            del self._buf[: end + 4]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or len(code) != 3 or not _is_digits(code):
                raise _BadReply(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:  # an interim reply (100 Continue, 103 Early Hints)
                continue
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise _BadReply(f"malformed header line: {line[:80]!r}")
                headers.add(name, value.strip(" \t"))
            self._start_body(status, version, headers)
            return True

    def _start_body(self, status: int, version: str, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        connection = headers.get("Connection", "").lower()
        self.keep_alive = ("close" not in connection
                           and (version != "HTTP/1.0" or "keep-alive" in connection))
        coding = headers.get("Transfer-Encoding", "").lower()
        lengths = set(headers.getall("Content-Length", ()))
        if status in _NO_BODY:
            self._framing, self._left = _LENGTH, 0
        elif coding:
            if coding.rsplit(",", 1)[-1].strip() != "chunked":
                raise _BadReply(f"unsupported Transfer-Encoding {coding!r}")
            self._framing = _CHUNKED
        elif lengths:
            value = lengths.pop()
            if lengths or not _is_digits(value):
                raise _BadReply("malformed Content-Length")
            self._framing, self._left = _LENGTH, int(value)
        else:
            self._framing, self.keep_alive = _UNTIL_CLOSE, False
        self.in_head = False
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._framing == _LENGTH and self._left == 0:
            self._finish()

    def _parse_body(self, data: bytes) -> None:
        if self.done:
            raise _BadReply("bytes after the end of the reply")
        if self._framing == _UNTIL_CLOSE:
            self._deliver(data)
        elif self._framing == _LENGTH:
            if len(data) > self._left:
                raise _BadReply("more body bytes than its Content-Length")
            self._left -= len(data)
            self._deliver(data)
            if self._left == 0:
                self._finish()
        else:
            self._parse_chunked(data)

    def _parse_chunked(self, data: bytes) -> None:
        at, n = 0, len(data)
        while at < n and not self.done:
            state = self._chunk_state
            if state == _DATA:
                take = min(self._left, n - at)
                self._deliver(data[at: at + take] if take < n else data)
                at += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = _DATA_END
                continue
            line_end = data.find(b"\n", at)
            if line_end < 0:
                self._buf += data[at:]
                if len(self._buf) > _MAX_HEAD:
                    raise _BadReply("a chunk's control line is too long")
                return
            self._buf += data[at: line_end + 1]
            at = line_end + 1
            line = bytes(self._buf).rstrip(b"\r\n")
            self._buf = bytearray()
            if state == _SIZE:
                size = line.split(b";", 1)[0].strip()
                # Hex digits only (RFC 9112's 1*HEXDIG): int() also takes a sign, "0x" and
                # "_", and a negative size would walk the parser back over bytes it read.
                if not size or len(size) > 16 or size.strip(_HEX_DIGITS):
                    raise _BadReply(f"malformed chunk size {size[:20]!r}")
                self._left = int(size, 16)
                self._chunk_state = _DATA if self._left else _TRAILER
            elif state == _DATA_END:
                if line:
                    raise _BadReply("a chunk did not end with CRLF")
                self._chunk_state = _SIZE
            elif not line:  # _TRAILER: the empty line after the trailers ends the reply
                self._finish()
        if at < n:
            raise _BadReply("bytes after the end of the reply")

    def _deliver(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail_head(self, exc: BaseException) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _fail_body(self, exc: BaseException) -> None:
        self.error = exc
        self._wake()


class _BadReply(Exception):
    """The worker's bytes are not a well-formed HTTP/1.1 reply."""


class Http1Reply:
    """One reply, handed out as it arrives; :meth:`release` gives the connection back (when the
    reply was read to its end and the connection may stay open) or closes it."""

    def __init__(self, client: Http1Client, origin: _Origin, conn: _Connection) -> None:
        self._client = client
        self._origin = origin
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers

    def chunks(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk: the reply is its own iterator (one frame per chunk)."""
        return self

    def __aiter__(self) -> Http1Reply:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise UpstreamBrokeOff("the reply was released")
        while True:
            if conn.chunks:
                return conn.take()
            if conn.done:
                raise StopAsyncIteration
            if conn.error is not None:
                raise conn.error
            await conn.wait_body(self._client.read_timeout_s)

    async def read(self) -> bytes:
        """The whole body, at most the client's ``max_reply_bytes`` (:class:`UpstreamBrokeOff`
        past them: a worker that never ends its reply must not fill the gateway's memory)."""
        parts = []
        size = 0
        limit = self._client.max_reply_bytes
        conn = self._conn
        while conn is not None and conn.chunks:  # what is there already, without awaiting
            parts.append(conn.take())
            size += len(parts[-1])
        if conn is None or not conn.done:
            async for chunk in self:
                parts.append(chunk)
                size += len(chunk)
                if size > limit:
                    break
        if size > limit:
            raise UpstreamBrokeOff(f"the reply is longer than {limit} bytes")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.done and not conn.chunks and conn.keep_alive and not conn.closed:
            self._client._keep(self._origin, conn)
        else:
            conn.close()


_Origin = tuple[str, str, int]  # scheme, host, port
# A request written: its connection, whether that was kept alive, and the future of its
# reply's head (:meth:`_Connection.send`).
_Sent = tuple[_Connection, bool, "asyncio.Future[None]"]
# A request waiting for a connection: the future its :data:`_Sent` goes to, its head and body.
_Waiting = tuple["asyncio.Future[_Sent]", bytes, bytes]


class Http1Client:
    """Keep-alive connections to workers, per origin; :meth:`post` sends one request."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 idle_timeout_s: float = 4.0, max_idle_per_origin: int = 256,
                 max_reply_bytes: int = 1 << 30,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        # A whole reply read at once (not a stream, which is relayed as it comes) is at most
        # this long: far past any completion, logprobs of a long prompt included.
        self.max_reply_bytes = max_reply_bytes
        self.idle_timeout_s = idle_timeout_s
        self._max_idle = max_idle_per_origin
        self._idle: dict[_Origin, deque[tuple[float, _Connection]]] = {}
        # Requests waiting for a connection, per origin, in the order they were posted.
        self._waiting: dict[_Origin, deque[_Waiting]] = {}
        self._connects: set[asyncio.Task[None]] = set()
        self._connecting: dict[_Origin, int] = {}  # connects under way per origin
        self._warming: dict[_Origin, int] = {}  # of those, opened ahead of any request
        self._heads: dict[tuple[str, URL], tuple[_Origin, bytes]] = {}
        # TLS to https:// origins: the given context, else the system's defaults (made once).
        self._ssl: ssl.SSLContext | None = ssl_context
        self._closed = False

    async def post(self, url: URL, headers: Mapping[str, str], body: bytes) -> Http1Reply:
        """Send ``body`` to ``url``; returns once the reply's status and headers are in."""
        return await self.send(url, headers, body)

    def send(self, url: URL, headers: Mapping[str, str], body: bytes,
             method: str = "POST") -> Coroutine[Any, Any, Http1Reply]:
        """:meth:`post`, with the request written (or its place taken in line) before this
        returns: a request sent at one instant and awaited later, from a task that starts on a
        later pass of the event loop, still reaches the worker before the requests sent after
        it. The coroutine returned must be awaited (it owns the connection)."""
        origin, start = self._request_start(url, method)
        # A GET without content says nothing of its length (RFC 9110, 8.6).
        lines = [start] if method == "GET" and not body else [
            start, b"Content-Length: %d\r\n" % len(body)]
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if "\n" in line[:-2] or "\r" in line[:-2]:
                raise ValueError(f"a line break in the header {name!r}")
            lines.append(line.encode("utf-8"))
        lines.append(b"\r\n")
        head = b"".join(lines)
        return self._reply(origin, head, body, self._write(origin, head, body))

    async def _reply(self, origin: _Origin, head: bytes, body: bytes,
                     written: _Sent | asyncio.Future[_Sent]) -> Http1Reply:
        """The reply to a request :meth:`_write` wrote or put in line."""
        if isinstance(written, asyncio.Future):
            waiter = written
            try:
                written = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    waiter.result()[0].close()  # written as the caller went away: unread
                raise
        conn, reused, reply_head = written
        try:
            try:
                await conn.wait_head(reply_head, self.read_timeout_s)
            except ConnectionError:
                if not reused or conn.received:
                    raise
                # A kept-alive connection the worker closed as the request went out: once more
                # on a new one (the worker never answered it, so it never ran it).
                conn.close()
                conn = await self._connect(origin)
                await conn.wait_head(conn.send(head, body), self.read_timeout_s)
        except (OSError, TimeoutError, _BadReply) as exc:
            conn.close()
            detail = str(exc) or "no reply within the read timeout"
            raise BackendUnavailable(f"{type(exc).__name__}: {detail}") from None
        except BaseException:
            conn.close()
            raise
        return Http1Reply(self, origin, conn)

    def _request_start(self, url: URL, method: str = "POST") -> tuple[_Origin, bytes]:
        """The origin and the request line + Host header of ``url`` (cached per method and
        URL)."""
        cached = self._heads.get((method, url))
        if cached is None:
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError(f"not an http(s) URL: {url}")
            port = url.port or (443 if url.scheme == "https" else 80)
            host = url.raw_host or url.host
            if ":" in host:  # an IPv6 literal
                host = f"[{host}]"
            authority = host if url.is_default_port() else f"{host}:{port}"
            start = f"{method} {url.raw_path_qs or '/'} HTTP/1.1\r\nHost: {authority}\r\n"
            if len(self._heads) >= 4096:
                self._heads.clear()
            cached = self._heads[method, url] = ((url.scheme, url.host, port),
                                                 start.encode("ascii"))
        return cached

    def _write(self, origin: _Origin, head: bytes,
               body: bytes) -> _Sent | asyncio.Future[_Sent]:
        """Write one request on an idle connection to ``origin``, or put it in line for the
        next one (see the module's notes): what was written, or the future it will be."""
        conn = self._take_idle(origin)
        if conn is not None:
            return conn, True, conn.send(head, body)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[_Sent] = loop.create_future()
        if self._closed:  # no connection will be handed to it: it would wait forever
            waiter.set_exception(BackendUnavailable("the client was closed"))
            return waiter
        self._waiting.setdefault(origin, deque()).append((waiter, head, body))
        self._connecting[origin] = self._connecting.get(origin, 0) + 1
        task = loop.create_task(self._connect_for_line(origin))
        self._connects.add(task)
        task.add_done_callback(self._connects.discard)
        return waiter

    def keep_warm(self, url: URL, count: int) -> int:
        """Open connections to ``url``'s origin until ``count`` are idle (and not past
        ``idle_timeout_s``) or being opened; returns how many connects this started. No
        I/O here: the connects run as tasks, and a connection they make goes to the first
        request waiting for one, else stays idle.

        A request that finds an idle connection is written in its own step of the event
        loop. One that must connect first is written only once the connect is through,
        several passes of the loop later, and in a burst of requests each pass first reads,
        parses and routes every other request of the burst: the first requests of a burst
        after the connections went idle reached their workers last (about 20 ms late in the
        opening burst of 32 agent prompts, BENCHMARKS.md)."""
        if self._closed:
            return 0
        origin = self._request_start(url, "GET")[0]
        wanted = min(count, self._max_idle) - self._idle_at(origin) - self._warming.get(origin, 0)
        for _ in range(wanted):
            self._warming[origin] = self._warming.get(origin, 0) + 1
            task = asyncio.get_running_loop().create_task(self._warm(origin))
            self._connects.add(task)
            task.add_done_callback(self._connects.discard)
        return max(wanted, 0)

    def idle(self, url: URL) -> int:
        """Connections to ``url``'s origin idle now, within ``idle_timeout_s``. Those idle
        past it are closed here, before their server closes them."""
        return self._idle_at(self._request_start(url, "GET")[0])

    def _idle_at(self, origin: _Origin) -> int:
        """:meth:`idle` for an origin."""
        idle = self._idle.get(origin)
        if not idle:
            return 0
        now = asyncio.get_running_loop().time()
        while idle and (idle[0][1].closed or now - idle[0][0] > self.idle_timeout_s):
            idle.popleft()[1].close()  # the oldest first: the rest are newer
        return sum(not conn.closed for _, conn in idle)

    async def _warm(self, origin: _Origin) -> None:
        try:
            conn = await self._connect(origin)
        except BackendUnavailable:
            return  # the health probes tell whether the worker is there
        finally:
            left = self._warming.get(origin, 1) - 1
            if left > 0:
                self._warming[origin] = left
            else:
                self._warming.pop(origin, None)
        self._hand(origin, conn, False)

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            at, conn = idle.pop()  # the most recently used first
            if conn.closed:
                continue
            if now - at > self.idle_timeout_s:  # and all those older than it
                conn.close()
                while idle:
                    idle.pop()[1].close()
                return None
            return conn
        return None

    def _next_waiter(self, origin: _Origin) -> _Waiting | None:
        line = self._waiting.get(origin)
        while line:
            waiting = line.popleft()
            if not waiting[0].done():
                return waiting
        if line is not None:
            del self._waiting[origin]
        return None

    async def _connect_for_line(self, origin: _Origin) -> None:
        """A connect started for a waiting request: a connection goes to the first in line;
        a failure too, unless the connects still under way can serve everyone waiting (a
        connection given back served the request that started this one)."""
        try:
            conn = await self._connect(origin)
        except BackendUnavailable as exc:
            left = self._connect_ended(origin)
            line = self._waiting.get(origin)
            if line is not None and left < sum(not w[0].done() for w in line):
                waiting = self._next_waiter(origin)
                if waiting is not None:
                    waiting[0].set_exception(exc)
            return
        except BaseException:
            self._connect_ended(origin)
            raise
        self._connect_ended(origin)
        self._hand(origin, conn, False)

    def _connect_ended(self, origin: _Origin) -> int:
        """One connect to ``origin`` is over; returns how many are still under way."""
        left = self._connecting.get(origin, 1) - 1
        if left > 0:
            self._connecting[origin] = left
        else:
            self._connecting.pop(origin, None)
        return left

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        scheme, host, port = origin
        try:
            async with asyncio.timeout(self.connect_timeout_s or None):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), host, port,
                    ssl=self._ssl_context() if scheme == "https" else None)
        except (OSError, TimeoutError) as exc:
            detail = "connect timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise BackendUnavailable(f"{type(exc).__name__}: {detail}") from None
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _keep(self, origin: _Origin, conn: _Connection) -> None:
        self._hand(origin, conn, True)

    def _hand(self, origin: _Origin, conn: _Connection, reused: bool) -> None:
        """A connection free for a request: the first waiting one's, or kept idle."""
        if self._closed or conn.closed:
            conn.close()
            return
        waiting = self._next_waiter(origin)
        if waiting is not None:
            waiter, head, body = waiting
            try:  # in whichever task gave the connection back: its failure is the waiter's
                sent = conn.send(head, body)
            except (OSError, RuntimeError) as exc:
                conn.close()
                waiter.set_exception(BackendUnavailable(f"{type(exc).__name__}: {exc}"))
                return
            waiter.set_result((conn, reused, sent))
            return
        idle = self._idle.setdefault(origin, deque())
        if len(idle) >= self._max_idle:
            idle.popleft()[1].close()
        idle.append((asyncio.get_running_loop().time(), conn))

    def close(self) -> None:
        """Close every idle connection (those in use close when their replies are released)."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop()[1].close()
        self._idle.clear()
        for task in list(self._connects):
            task.cancel()
        for line in self._waiting.values():
            for waiter, _, _ in line:
                if not waiter.done():
                    waiter.set_exception(BackendUnavailable("the client was closed"))
        self._waiting.clear()
