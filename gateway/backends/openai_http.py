"""Workers that speak OpenAI HTTP: our reference worker, vLLM, SGLang.

Completions go through :class:`gateway.backends.http1.Http1Client` (kept-alive connections per
worker, one write per request, a reply parsed as it arrives), with an explicit connect timeout
and a read timeout between bytes (a long generation keeps streaming; a stuck worker is cut
off); the number of requests in flight per worker and in total is bounded by the gateway's
connection slots. Health probes go through a second such client, on connections of their own;
admin calls use one pooled :class:`aiohttp.ClientSession`.

Tenant isolation: the gateway passes the request's cache namespace (derived from the tenant and
the client's ``cache_salt``, see :class:`gateway.auth.TenantHasher`) as the ``x-cache-namespace``
header, which our reference worker honours. vLLM has no such header; for ``kind = "vllm"`` the
namespace, joined with the client's salt as our worker joins them, replaces ``cache_salt``, so
tenants never share KV blocks there either. vLLM reports cached prompt tokens only in a
stream's final usage event, so streams to ``kind = "vllm"`` always ask for it
(``stream_options.include_usage``) and the gateway strips that event when the client did not
ask for it.

Health probes read ``/health`` and ``/v1/models``, and scrape ``/metrics`` for vLLM's engine
gauges and counters (``vllm:num_requests_running``, ``..._waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries/hits``), which the gateway shows per worker and exports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from gateway.backends.base import (
    BackendUnavailable,
    UpstreamBrokeOff,
    UpstreamRequest,
    WorkerProbe,
)
from gateway.backends.http1 import Http1Client, Http1Reply
from gateway.backends.kinds import BackendKind, BackendOptions
from gateway.backends.metrics_page import parse_engine_metrics
from gateway.contracts.engine_owners import owner_of
from gateway.contracts.engine_paths import COMPLETION_PATHS
from gateway.contracts.headers import NAMESPACE_HEADER
from gateway.contracts.kv_keys import engine_namespace
from gateway.openai_schema import encode_body, with_fields
from gateway.routing.types import Worker

# The request header that pins a request to one data-parallel engine rank behind an endpoint
# (vLLM's and SGLang's; case does not matter to either).
RANK_HEADER = "X-data-parallel-rank"
# Bytes of an unfinished stream event past which it is relayed as it is: no usage report is
# that long.
_MAX_PENDING_EVENT = 1 << 20
# The longest probe reply read (a /metrics page of many engines and models is a few MB).
_MAX_PROBE_REPLY = 64 << 20
# How long a probe connection is kept idle for the next probe. The relay's limit (4 s) stays
# under uvicorn's 5 s keep-alive; a probe of each worker comes once a health interval (5 s),
# so under that limit every probe would open a connection (about 0.5 ms of the gateway's
# CPU). Longer is safe for GETs: a connection the server closed while idle is seen closed and
# skipped, and one it closes as the probe goes out is asked once more on a new one.
_PROBE_IDLE_S = 60.0
# How a probe's request can fail: unreachable, cut off, too slow, not JSON or not HTTP.
_PROBE_FAILURES = (TimeoutError, BackendUnavailable, UpstreamBrokeOff, OSError, ValueError)


def model_versions(entries: list[dict[str, Any]]) -> dict[str, str]:
    """Model id -> version from ``/v1/models`` entries: our worker's ``revision`` and
    ``tokenizer_hash``, vLLM's ``root`` (the weights it loaded) when it differs from the id.
    Models that report none of these are left out."""
    out: dict[str, str] = {}
    for m in entries:
        root = m.get("root")
        parts = [str(m[k]) for k in ("revision", "tokenizer_hash") if m.get(k)]
        if isinstance(root, str) and root and root != m["id"]:
            parts.append(root)
        if parts:
            out[str(m["id"])] = "/".join(parts)
    return out


def _is_usage_only(event: bytes) -> bool:
    """An SSE event that is only the final usage report (``"choices": []`` and a usage)."""
    if b'"usage"' not in event:
        return False
    data = event.strip().removeprefix(b"data:").strip()
    try:
        payload = json.loads(data)
    except ValueError:
        return False
    return (isinstance(payload, dict) and payload.get("choices") == []
            and bool(payload.get("usage")))


class HTTPReply:
    """One upstream response. With ``strip_usage`` (a stream for which the gateway asked the
    server for a usage report the client did not ask for), that final usage event is kept in
    :attr:`withheld` instead of being relayed."""

    def __init__(self, response: Http1Reply, *, strip_usage: bool = False) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self._strip_usage = strip_usage and response.headers.get(
            "Content-Type", "").startswith("text/event-stream")
        self.withheld = b""

    def chunks(self) -> AsyncIterator[bytes]:
        return self._stripped() if self._strip_usage else self._response.chunks()

    async def _stripped(self) -> AsyncIterator[bytes]:
        """The stream's events as they complete, the usage-only one withheld. What waits for
        its event's end is kept in one growing buffer and searched only where it grew, and
        passed on once it is longer than any usage report (a worker that never ends an event
        must not make the relay quadratic, nor hold the stream back)."""
        pending = bytearray()
        async for chunk in self._response.chunks():
            start = max(0, len(pending) - 1)  # an event's end may span two chunks
            pending += chunk
            end = pending.rfind(b"\n\n", start)
            if end < 0:
                if len(pending) > _MAX_PENDING_EVENT:
                    out = bytes(pending)
                    pending.clear()
                    yield out
                continue
            ready = bytes(pending[: end + 2])
            del pending[: end + 2]
            out = self._without_usage(ready)
            if out:
                yield out
        if pending:
            yield self._without_usage(bytes(pending)) or b""

    def _without_usage(self, events: bytes) -> bytes:
        if b'"usage"' not in events:
            return events
        kept: list[bytes] = []
        for event in events.split(b"\n\n"):
            if _is_usage_only(event):
                self.withheld += event + b"\n\n"
            elif event:
                kept.append(event + b"\n\n")
        return b"".join(kept)

    async def read(self) -> bytes:
        return await self._response.read()

    def release(self) -> None:
        self._response.release()


class OpenAIHTTPBackend:
    relays_engine_api = True  # any path of the engine's API (gateway.engine_api)

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        max_connections_per_worker: int,
        probe_timeout_s: float = 2.0,
        warm_connections: int = 0,
        namespace_in_body: bool = False,
        api_keys: Mapping[str, str] | None = None,
        default_api_key: str = "",
        admin_token: str = "",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._namespace_in_body = namespace_in_body
        self._ssl_context = ssl_context
        self._admin_token = admin_token  # for workers' /admin/*; else their API key
        self._api_keys = dict(api_keys or {})  # worker id -> key it expects
        self._default_api_key = default_api_key
        self._limits = (max_connections, max_connections_per_worker)
        # Relay connections opened ahead of any request at each healthy probe of a worker
        # (Http1Client.keep_warm): the relay closes an idle one after 4 s, within a health
        # interval (5 s), so a burst after quiet writes its first requests at once.
        self._warm_connections = warm_connections
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._probe_timeout_s = probe_timeout_s
        self._client: aiohttp.ClientSession | None = None
        self._relay = Http1Client(connect_timeout_s, read_timeout_s,
                                   max_idle_per_origin=max_connections_per_worker,
                                   ssl_context=ssl_context)
        # Health probes: three GETs per worker each interval, on connections of their own
        # (a probe never waits behind the relay's requests, nor they behind it), kept from
        # one interval to the next (see _PROBE_IDLE_S).
        self._prober = Http1Client(min(connect_timeout_s, probe_timeout_s), probe_timeout_s,
                                   idle_timeout_s=_PROBE_IDLE_S, max_idle_per_origin=2,
                                   max_reply_bytes=_MAX_PROBE_REPLY, ssl_context=ssl_context)
        # Parsed upstream URLs (worker URL + path): the client parses a string on every call.
        self._urls: dict[tuple[str, str], URL] = {}
        # (server URL, endpoint id) -> the probe of it in flight, shared by its ranks.
        self._probing: dict[tuple[str, str], asyncio.Future[tuple[WorkerProbe, str | None]]] = {}

    async def start(self) -> None:
        """Open the pooled session (it must be created inside the running event loop)."""
        limit, per_host = self._limits
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, limit_per_host=per_host,
                                           ssl=self._ssl_context or True),
            timeout=self._timeout,
            # Bodies are relayed as they come: never ask for a compressed one the client would
            # receive without its Content-Encoding.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            cookie_jar=aiohttp.DummyCookieJar(),  # workers set no cookies worth keeping
        )

    @property
    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("backend used before start()")
        return self._client

    def _credentials(self, worker: Worker) -> dict[str, str]:
        key = self._api_keys.get(worker.endpoint_id, self._default_api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _admin_credentials(self, worker: Worker) -> dict[str, str]:
        if self._admin_token:
            return {"Authorization": f"Bearer {self._admin_token}"}
        return self._credentials(worker)

    async def open(self, worker: Worker, request: UpstreamRequest) -> HTTPReply:
        return await self.send(worker, request)

    def send(self, worker: Worker,
             request: UpstreamRequest) -> Coroutine[Any, Any, HTTPReply]:
        """:meth:`open`, the request written to the worker (or in line for a connection)
        before this returns (:meth:`Http1Client.send`)."""
        body = request.body
        if request.method != "POST":  # about a stored response: nothing to send but its path
            headers = {**request.headers, **self._credentials(worker)}
            if request.request_id:
                headers["x-request-id"] = request.request_id
            if worker.rank is not None:
                headers[RANK_HEADER] = str(worker.rank)
            target = URL(worker.url + request.path, encoded=True)
            return _opened(self._relay.send(target, headers, b"", request.method), False)
        headers = {**request.headers, **self._credentials(worker),
                   "Content-Type": "application/json"}
        if request.request_id:
            headers["x-request-id"] = request.request_id
        if worker.rank is not None:  # the engine rank behind the endpoint that serves it
            headers[RANK_HEADER] = str(worker.rank)
        namespace = request.namespace
        strip_usage = False
        if self._namespace_in_body:
            fields: dict[str, Any] = {}
            if namespace:
                # What our worker makes of header + salt, so both kinds key a request alike.
                salt = body.get("cache_salt")
                fields["cache_salt"] = engine_namespace(
                    namespace, salt if isinstance(salt, str) else "")
            # vLLM reports cached tokens only in usage: have every stream end with it, and
            # hold that event back when the client did not ask for it.
            options = body.get("stream_options")
            if request.path in COMPLETION_PATHS and body.get("stream") is True and not (
                isinstance(options, dict) and options.get("include_usage") is True
            ):
                extra = options if isinstance(options, dict) else {}
                fields["stream_options"] = {**extra, "include_usage": True}
                strip_usage = True
            if fields:
                body = with_fields(body, fields)
        elif namespace:
            headers[NAMESPACE_HEADER] = namespace
        data = encode_body(body)
        url = self._urls.get((worker.url, request.path))
        if url is None:
            if len(self._urls) >= 4096:
                self._urls.clear()
            url = self._urls[worker.url, request.path] = URL(worker.url + request.path)
        return _opened(self._relay.send(url, headers, data), strip_usage)

    async def probe(self, worker: Worker) -> WorkerProbe:
        """``worker``'s health, models and engine metrics. The data-parallel ranks of one
        server share one probe of it at a time (each takes its own engine's series), so a
        round asks a server of N ranks once, not N times."""
        key = (worker.url, worker.endpoint_id)
        pending = self._probing.get(key)
        if pending is None:
            pending = self._probing[key] = asyncio.ensure_future(self._probe_server(worker))
            pending.add_done_callback(lambda _: self._probing.pop(key, None))
        # Shielded: one rank's caller going away must not cancel the others' probe.
        probe, page = await asyncio.shield(pending)
        if page is None:
            return probe
        return dataclasses.replace(probe, metrics=parse_engine_metrics(page, worker.rank))

    async def _probe_server(self, worker: Worker) -> tuple[WorkerProbe, str | None]:
        """A probe of the server ``worker`` is served at, and its ``/metrics`` page (None when
        the probe failed before it, "" when the server exposes none)."""
        auth = self._credentials(worker)
        try:
            status, _ = await self._get(worker, "/health", auth)
            if status != 200:
                return WorkerProbe(False, frozenset(), f"/health answered {status}"), None
            status, listing = await self._get(worker, "/v1/models", auth)
            if status != 200:
                return WorkerProbe(False, frozenset(), f"/v1/models answered {status}"), None
            payload = json.loads(listing)
            status, page = await self._get(worker, "/metrics", auth)
        except _PROBE_FAILURES as exc:
            return WorkerProbe(False, frozenset(), f"{type(exc).__name__}: {exc}",
                               timed_out=isinstance(exc, TimeoutError)), None
        entries = [
            m for m in payload.get("data", [])
            if isinstance(m, dict) and isinstance(m.get("id"), str)
        ] if isinstance(payload, dict) else []
        models = frozenset(str(m["id"]) for m in entries)
        text = page.decode("utf-8", "replace") if status == 200 else ""
        if self._warm_connections:
            self._relay.keep_warm(self._url(worker, ""), self._warm_connections)
        return WorkerProbe(True, models, versions=model_versions(entries),
                           engine=owner_of(entries)), text

    def _url(self, worker: Worker, path: str) -> URL:
        """``path`` on ``worker``'s server, parsed once."""
        url = self._urls.get((worker.url, path))
        if url is None:
            if len(self._urls) >= 4096:
                self._urls.clear()
            url = self._urls[worker.url, path] = URL(worker.url + path)
        return url

    async def _get(self, worker: Worker, path: str,
                   headers: Mapping[str, str]) -> tuple[int, bytes]:
        """``GET path`` of ``worker``'s server through the probes' client: the status and the
        whole body, within the probe timeout."""
        url = self._url(worker, path)
        async with asyncio.timeout(self._probe_timeout_s):
            reply = await self._prober.send(url, headers, b"", "GET")
            try:
                return reply.status, await reply.read()
            finally:
                reply.release()

    async def invalidate(self, worker: Worker) -> str:
        """Drop the worker's cached prefixes (its model changed): our worker's
        ``/admin/flush``, vLLM's ``/reset_prefix_cache`` (served with VLLM_SERVER_DEV_MODE=1).
        Returns what happened, for the log."""
        path = "/reset_prefix_cache" if self._namespace_in_body else "/admin/flush"
        try:
            async with self._session.post(
                worker.url + path, timeout=self._probe_timeout,
                headers=self._admin_credentials(worker),
            ) as response:
                await response.read()
                return f"POST {path}: HTTP {response.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return f"POST {path} failed: {type(exc).__name__}: {exc}"

    async def hot_prompts(self, worker: Worker, limit: int) -> list[dict[str, Any]]:
        """The prompts a reference worker sees most (``GET /admin/hot-prompts``), to warm a
        peer; empty when the worker has none to give (another engine, no admin secret there,
        not reachable)."""
        if self._namespace_in_body:  # vLLM keeps no such list
            return []
        try:
            async with self._session.get(
                worker.url + "/admin/hot-prompts", params={"limit": str(limit)},
                timeout=self._probe_timeout, headers=self._admin_credentials(worker),
            ) as response:
                if response.status != 200:
                    return []
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return []
        data = payload.get("data") if isinstance(payload, dict) else None
        return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []

    async def close(self) -> None:
        for pending in self._probing.values():
            pending.cancel()
        self._relay.close()
        self._prober.close()
        if self._client is not None:
            await self._client.close()
            self._client = None


async def _opened(reply: Coroutine[Any, Any, Http1Reply], strip_usage: bool) -> HTTPReply:
    return HTTPReply(await reply, strip_usage=strip_usage)


def target_url(url: str) -> str:
    """Where requests go: ``vllm+http://h:p`` is served at ``http://h:p``, and the query of a
    worker URL names its credentials (see :mod:`gateway.credentials`), not a path."""
    return url.removeprefix("vllm+").split("?", 1)[0]


def worker_id(url: str) -> str:
    """``host:port`` of a worker URL (the scheme's default port when it names none)."""
    parts = urlsplit(target_url(url))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL must look like http://host:port, got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def _builder(namespace_in_body: bool) -> Callable[[BackendOptions], OpenAIHTTPBackend]:
    def build(options: BackendOptions) -> OpenAIHTTPBackend:
        return OpenAIHTTPBackend(
            connect_timeout_s=options.connect_timeout_s,
            read_timeout_s=options.read_timeout_s,
            max_connections=options.max_connections,
            max_connections_per_worker=options.max_connections_per_worker,
            warm_connections=options.warm_connections,
            namespace_in_body=namespace_in_body,
            api_keys=options.api_keys,
            default_api_key=options.default_api_key,
            admin_token=options.admin_token,
            ssl_context=options.ssl_context,
        )

    return build


# Our reference worker, SGLang or any OpenAI-compatible server: the namespace as a header.
OPENAI = BackendKind("openai", ("http", "https"), worker_id, target_url, _builder(False),
                     data_parallel_ranks=True)
# A vLLM server (``vllm+http://``): the namespace goes into ``cache_salt``.
VLLM = BackendKind("vllm", ("vllm+http", "vllm+https"), worker_id, target_url, _builder(True),
                   data_parallel_ranks=True)
