"""Workers that speak OpenAI HTTP: our reference worker, vLLM, SGLang.

One pooled :class:`aiohttp.ClientSession` for all workers, with a bounded connection pool (in
total and per worker), an explicit connect timeout and a read timeout between bytes (a long
generation keeps streaming; a stuck worker is cut off).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from gateway.backends.base import BackendUnavailable, WorkerProbe
from gateway.routing.types import Worker


class HTTPReply:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def read(self) -> bytes:
        return await self._response.read()

    def release(self) -> None:
        self._response.release()


class OpenAIHTTPBackend:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        max_connections_per_worker: int,
        probe_timeout_s: float = 2.0,
    ) -> None:
        self._limits = (max_connections, max_connections_per_worker)
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._client: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the pooled session (it must be created inside the running event loop)."""
        limit, per_host = self._limits
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, limit_per_host=per_host),
            timeout=self._timeout,
            auto_decompress=False,
        )

    @property
    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("backend used before start()")
        return self._client

    async def open(
        self, worker: Worker, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> HTTPReply:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        try:
            response = await self._session.post(
                worker.url + path,
                data=data,
                headers={**headers, "Content-Type": "application/json"},
            )
        except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return HTTPReply(response)

    async def probe(self, worker: Worker) -> WorkerProbe:
        try:
            async with self._session.get(
                worker.url + "/health", timeout=self._probe_timeout
            ) as health:
                if health.status != 200:
                    return WorkerProbe(False, frozenset(), f"/health answered {health.status}")
            async with self._session.get(
                worker.url + "/v1/models", timeout=self._probe_timeout
            ) as listing:
                payload = await listing.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            return WorkerProbe(False, frozenset(), f"{type(exc).__name__}: {exc}")
        models = frozenset(
            str(m["id"])
            for m in payload.get("data", [])
            if isinstance(m, dict) and isinstance(m.get("id"), str)
        ) if isinstance(payload, dict) else frozenset()
        return WorkerProbe(True, models)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
