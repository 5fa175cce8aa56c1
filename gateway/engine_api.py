"""The engine's API besides completions, relayed: embeddings, pooling, scores and reranking,
and the tokenizer (:data:`~gateway.contracts.engine_paths.ENGINE_API_PATHS`).

A client that points its SDK at the gateway uses the same base URL for embeddings (a RAG
pipeline embeds its documents and its questions where it asks for answers) and for vLLM's
``/tokenize``; sglang-router and smg relay these paths, and a gateway that answered them 404
would break such clients. Each request gets what every client request gets: the API key and the
tenant's limits, the body limits, OpenAI-shaped errors of the gateway's own, and a retry on
another worker when one fails before replying.

*Where it goes.* These requests carry no prefix worth routing by (a pooling model runs each
input once, and a tokenizer holds nothing), so the worker is the least loaded of the healthy
ones that serve the model: fewest requests in flight per unit of ring weight, ties taken in
turn. While it runs the request counts in its worker's load, as a completion does, so the
routing of completions sees it. ``model`` may be left out when the pool serves one model, as
the engines take it.

*Tenants.* Pooling requests carry the tenant's cache namespace as completions do (vLLM's
``cache_salt``, which keeps tenants apart in the prefix cache of the pooling models that use
one; our worker's namespace header); tokenization caches nothing and goes as it came.

*Targets.* Only workers spoken to over HTTP (``openai``, ``vllm``) serve these paths; a
SageMaker endpoint takes completions only, and a model served by nothing else answers 404.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from gateway.api import STATE, admit_unread, read_body
from gateway.auth import AUTH_KEY
from gateway.backends.base import BackendUnavailable, UpstreamBrokeOff, UpstreamRequest
from gateway.contracts.engine_paths import ENGINE_API_PATHS, POOLING_PATHS
from gateway.errors import (
    ConnectionQueueFull,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    NoWorkerAvailable,
)
from gateway.guard import NoFirstByte, SlotTimeout
from gateway.limits import LIMITS_KEY
from gateway.openai_schema import decode_json_object
from gateway.proxy import tried_everywhere
from gateway.routing.types import WorkerView
from gateway.state import GatewayState
from gateway.telemetry.middleware import record_of

log = logging.getLogger(__name__)

POLICY = "engine_api"  # the policy label of these requests in metrics and headers


class LeastLoaded:
    """The worker for one request: fewest requests in flight per unit of weight, ties in
    turn (so equal workers share a burst rather than its first one taking all of it)."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, views: list[WorkerView]) -> WorkerView:
        self._turn += 1
        start = self._turn % len(views)
        turned = views[start:] + views[:start]
        return min(turned, key=lambda v: v.inflight_requests / (v.worker.weight or 1.0))


PICKER_KEY = web.AppKey("engine_api_picker", LeastLoaded)


def _model(body: dict[str, Any], served: frozenset[str]) -> str:
    """The model a request names, or the pool's only one."""
    model = body.get("model")
    if model is None:
        if len(served) == 1:
            return next(iter(served))
        raise InvalidRequest("you must provide a model parameter", param="model",
                             code="missing_required_parameter")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model", code="invalid_type")
    if model not in served:
        raise ModelNotFound(f"the model {model[:200]!r} does not exist; available: "
                            f"{', '.join(sorted(served))}", param="model")
    return model


def _candidates(state: GatewayState, model: str | None, excluded: set[str],
                only: str | None = None) -> list[WorkerView]:
    """The workers that may take the request: healthy, not excluded or blocked, serving
    ``model`` (None: any) over HTTP; ``only``: that worker or none."""
    blocked = state.guard.blocked(state.pool, time.monotonic())
    return [v for v in state.pool.snapshot(time.monotonic()).workers
            if v.healthy and v.id not in excluded and v.id not in blocked
            and (only is None or v.id == only)
            and (model is None or v.worker.serves(model))
            and state.backend_for(v.worker).relays_engine_api]


async def relay(request: web.Request) -> web.StreamResponse:
    app = request.app
    state = app[STATE]
    settings = state.settings
    limits = app[LIMITS_KEY]
    identity, hold = admit_unread(request)
    try:
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s, hold)
        body = decode_json_object(raw)
        served = state.pool.models()
        if not served and not state.pool.any_healthy():
            raise NoWorkerAvailable("no healthy worker right now; retry shortly")
        model = _model(body, served)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest("'cache_salt' must be a string", param="cache_salt",
                                 code="invalid_type")
        path = request.path
        namespace = (app[AUTH_KEY].hasher.namespace(identity.tenant_id, salt or "")
                     if path in POOLING_PATHS else "")
        record = record_of(request)
        record.tenant, record.model, record.policy = identity.tenant_id, model, POLICY
        # What it weighs in its worker's load: about a token per chars_per_token bytes.
        cost = max(1, int(len(raw) / settings.chars_per_token))
        upstream = UpstreamRequest(path=path, body=body, namespace=namespace)
        del raw
        async with limits.admitted(identity.tenant, cost):
            return await dispatch(request, state, upstream, model, cost)
    finally:
        hold.release()


async def dispatch(request: web.Request, state: GatewayState, upstream: UpstreamRequest,
                    model: str | None, cost: int, only: str | None = None,
                    policy: str = POLICY) -> web.Response:
    """Send ``upstream`` to the least loaded worker for ``model``; on a failure before its
    reply (unreachable, no reply in time, 429 or 5xx), to the next. ``only``: to that worker,
    and nowhere else if it fails (a stored response's worker)."""
    record = record_of(request)
    guard = state.guard
    excluded: set[str] = set()
    problems: list[str] = []
    busy = 0
    usable = 0
    for _ in range(state.settings.max_attempts):
        views = _candidates(state, model, excluded, only)
        if not views:
            break
        usable += 1
        view = request.app[PICKER_KEY].pick(views)
        wid, worker = view.id, view.worker
        record.worker = wid
        excluded.add(wid)
        guard.breakers.attempt(wid, time.monotonic())
        state.pool.acquire(wid, cost)
        release_slot = None
        try:
            release_slot = guard.slots.try_take(wid) or await guard.slots.take(wid)
            attempt = upstream.with_headers(record.upstream_headers({}))
            reply = await guard.open(wid, state.backend_for(worker).send(worker, attempt))
            guard.liveness.heard(wid, time.monotonic())
            try:
                payload = await reply.read()
            finally:
                reply.release()
            record.upstream_done(reply.status)
            if reply.status != 429 and reply.status < 500:
                guard.breakers.success(wid)
                state.metrics.requests.labels(policy, str(reply.status)).inc()
                return web.Response(body=payload, status=reply.status, headers={
                    "Content-Type": reply.headers.get("Content-Type", "application/json"),
                    "x-route-worker": wid, "x-route-policy": policy,
                })
            problems.append(f"{wid}: HTTP {reply.status}")
            if reply.status != 429:
                guard.breakers.failure(wid, time.monotonic())
        except SlotTimeout as exc:
            record.upstream_done(None, str(exc))
            if exc.scope != wid:  # the gateway's own limit: no other worker helps
                raise ConnectionQueueFull(
                    f"the gateway is at its connection limit: {exc}") from None
            busy += 1
            problems.append(f"{wid}: {exc}")
        except (NoFirstByte, BackendUnavailable, UpstreamBrokeOff, asyncio.IncompleteReadError,
                TimeoutError) as exc:
            record.upstream_done(None, str(exc) or type(exc).__name__)
            if isinstance(exc, BackendUnavailable):
                state.pool.mark_down(wid, str(exc))
            guard.breakers.failure(wid, time.monotonic())
            problems.append(f"{wid}: {exc or type(exc).__name__}")
        finally:
            if release_slot is not None:
                release_slot()
            guard.breakers.settled(wid)
            state.pool.release(wid, cost)
        state.metrics.retries.labels(wid).inc()
    state.metrics.requests.labels(policy, "unavailable").inc()
    if not usable and only is not None:
        raise NoWorkerAvailable(f"the worker that holds this response ({only}) is not "
                                "serving right now; retry shortly")
    if not usable:
        serving = [v for v in state.pool.snapshot(time.monotonic()).workers
                   if v.healthy and (model is None or v.worker.serves(model))]
        if serving and not any(state.backend_for(v.worker).relays_engine_api for v in serving):
            raise NotFound(f"{request.path} is not served for the model {model!r}: its workers "
                           "take completions only (SageMaker endpoints)")
        raise NoWorkerAvailable("no healthy worker serves this request right now; retry shortly")
    raise tried_everywhere(problems, busy, request.path)


def add_routes(app: web.Application) -> None:
    app[PICKER_KEY] = LeastLoaded()
    for path in sorted(ENGINE_API_PATHS):
        app.router.add_post(path, relay)
