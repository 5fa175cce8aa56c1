"""The contract between the gateway and a kind of inference target.

A backend opens one upstream exchange and hands back an :class:`UpstreamReply` as soon as the
status and headers are known, before the body: the caller decides from the status whether to
retry on another worker (nothing has reached the client yet) or to start relaying the body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.routing.types import Worker
from gateway.values import value


class BackendUnavailable(Exception):
    """The worker could not be reached (refused, reset, timed out) before any reply."""


class UpstreamBrokeOff(Exception):
    """The worker's reply stopped before its end (the connection closed or reset, or its
    framing was malformed) after its status and headers came."""


# Key in WorkerProbe.metrics: the worker's KV cache capacity in tokens (its blocks x block size).
CACHE_CAPACITY_TOKENS = "cache_capacity_tokens"
# How many data-parallel engines a server's metrics speak for (vLLM's ``engine`` label), when
# more than one: probed as a whole, such a server is worth listing rank by rank.
ENGINE_RANKS = "engine_ranks"


@dataclass(frozen=True, slots=True)
class WorkerProbe:
    """One health probe. ``metrics`` holds the engine metrics scraped from the worker, if any,
    and :data:`CACHE_CAPACITY_TOKENS` when the worker told its KV cache size."""

    healthy: bool
    models: frozenset[str]
    error: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)  # engine metrics, if scraped
    # model -> its version as the worker reports it (revision, weights and tokenizer hashes);
    # absent when the worker says nothing about versions.
    versions: Mapping[str, str] = field(default_factory=dict)
    # The probe failed only by waiting too long (not refused, not an error answer): a hung
    # worker, or one (or a gateway) too busy to answer in time.
    timed_out: bool = False
    # The engine, as its model listing names itself (``owned_by``; gateway.contracts.
    # engine_owners); "" when it does not say.
    engine: str = ""


@value
class UpstreamRequest:
    """One request for a worker, as the gateway hands it to a backend.

    ``namespace`` is the tenant's cache namespace (our worker keys its cache by it, vLLM gets it
    as ``cache_salt``); ``anchor`` is the prefix anchor (hex) of the routing decision, which a
    target that routes inside itself can use (SageMaker ``PrefixAwareId``, stateful sessions).
    ``headers`` are the plain HTTP headers passed on as they are (``x-request-id``).
    ``method`` is POST with ``body`` as JSON, or GET / DELETE with no body (the paths about a
    stored response; ``path`` then carries its query string).
    """

    path: str
    body: Mapping[str, Any]
    namespace: str = ""
    anchor: str = ""
    request_id: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    method: str = "POST"

    def with_headers(self, headers: Mapping[str, str]) -> UpstreamRequest:
        """This request with ``headers`` instead of its own (``dataclasses.replace`` without
        its per-call field introspection: once per attempt on the request path)."""
        return UpstreamRequest(self.path, self.body, self.namespace, self.anchor,
                               self.request_id, headers, self.method)


class UpstreamReply(Protocol):
    status: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk by chunk."""
        ...

    async def read(self) -> bytes: ...

    def release(self) -> None: ...


class Backend(Protocol):
    # Whether it relays any path of an engine's HTTP API (embeddings, /tokenize, ...:
    # gateway.engine_api) and not only completions.
    relays_engine_api: bool

    async def start(self) -> None:
        """Open pooled resources; called once inside the running event loop."""
        ...

    async def open(self, worker: Worker, request: UpstreamRequest) -> UpstreamReply:
        """Send one request; raise :class:`BackendUnavailable` if the worker is unreachable."""
        ...

    def send(self, worker: Worker,
             request: UpstreamRequest) -> Coroutine[Any, Any, UpstreamReply]:
        """:meth:`open`, started now: where the backend orders the requests to a worker, this
        one takes its place before this returns, so a request awaited from a task that runs
        later still goes out before the ones sent after it. Await what it returns."""
        ...

    async def probe(self, worker: Worker) -> WorkerProbe: ...

    async def close(self) -> None: ...
