"""HTTP handlers: the OpenAI-compatible surface of the gateway, plus health and admin views."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.auth import ANONYMOUS, AUTH_KEY, IDENTITY_KEY, Identity
from gateway.backends.base import UpstreamRequest
from gateway.contracts.responses import RESPONSES_PATH, as_chat_body
from gateway.errors import ModelNotFound, NoWorkerAvailable, PayloadTooLarge, RequestTimeout
from gateway.fingerprint import Namespace
from gateway.limits import LIMITS_KEY, BodyHold
from gateway.misses import prompt_head_hash
from gateway.normal_texts import TextScope
from gateway.normalize import NormalizeOptions, NormalPrefix
from gateway.openai_schema import (
    KnownHistory,
    ParsedRequest,
    decode_json_object,
    forwarded_body,
    parse_chat,
    parse_completion,
    parse_responses,
)
from gateway.openapi import openapi_document
from gateway.proxy import dispatch
from gateway.resources import DISCOVERY_KEY, REBALANCER_KEY, STORE_KEY, SYNC_KEY
from gateway.routing.types import RouteRequest
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.store.base import StoreUnavailable
from gateway.store.peers import PeerLink
from gateway.telemetry.middleware import record_of
from gateway.warmup import WarmupStatus
from gateway.warmup_sources import WarmPrompt

STATE = web.AppKey("state", GatewayState)
T = TypeVar("T")

Parser = Callable[
    [dict[str, Any], NormalizeOptions, TextScope | None, KnownHistory | NormalPrefix | None,
     bool],
    ParsedRequest,
]


def request_cost(parsed: ParsedRequest, settings: GatewaySettings) -> tuple[int, int]:
    """(prompt tokens, load in tokens) of a request as estimated before it runs: every prompt
    of a batch, plus ``max_tokens`` (or the default budget) for every output it asks for."""
    prompt_tokens = (math.ceil(parsed.prompt_chars / settings.chars_per_token)
                     + parsed.prompt_token_ids)
    budget = parsed.max_tokens or settings.default_max_tokens
    return prompt_tokens, prompt_tokens + parsed.sequences * budget


async def _body_bytes(request: web.Request, limit: int, hold: BodyHold) -> bytes:
    """The request body, at most ``limit`` bytes (:class:`PayloadTooLarge` beyond; a body
    whose Content-Length says so was refused by :func:`_routed` before this), joined once
    from the chunks the server buffered, where ``request.read()`` copies each chunk into a
    growing buffer and then the whole buffer again. A chunked body takes its share of the
    gateway's body budget chunk by chunk (``hold``); a declared one took it before."""
    declared = request.content_length
    content = request.content
    chunks = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body too large: over {limit} bytes")
        if declared is None:
            hold.grow(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)  # one chunk: that chunk itself, no copy


async def read_body(
    request: web.Request, limit: int, timeout_s: float, hold: BodyHold
) -> bytes:
    """The request body, if the client sends all of it within ``timeout_s``."""
    content = request.content
    if content.is_eof():  # all of it arrived already: taken as it is, nothing to wait for
        raw = content.read_nowait()
        if len(raw) > limit:
            raise PayloadTooLarge(f"request body too large: over {limit} bytes")
        if request.content_length is None:
            hold.grow(len(raw))
        return raw
    try:
        async with asyncio.timeout(timeout_s):
            return await _body_bytes(request, limit, hold)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} seconds"
        ) from None


async def prepare(
    app: web.Application, body: dict[str, Any], parse: Parser, path: str, identity: Identity,
    known: KnownHistory | NormalPrefix | None = None, keep_history: bool = False,
    on_thread: bool = False,
) -> tuple[ParsedRequest, RouteRequest, str]:
    """Validate a completion request of ``identity`` to ``app`` and build what routing needs,
    and the request's cache namespace (raises 4xx errors). ``known``: the leading messages of
    a chat, or the text a completions prompt begins with, as an earlier request's parse left
    them; ``keep_history``: keep a long chat's or prompt's for a later one
    (:mod:`gateway.chat_histories`, :mod:`gateway.prompt_histories`). ``on_thread``: parse
    on the parse pool's thread, with nothing known or kept (:mod:`gateway.parse_pool`)."""
    state = app[STATE]
    settings = state.settings
    opts = settings.normalize_options()
    if on_thread:
        parsed = await state.parse_pool.parse(
            lambda b, o: parse(b, o, None, None, False), body, opts)
    else:
        salt = body.get("cache_salt")
        # Long texts found normal are remembered per tenant and cache salt: never across them.
        seen = state.normal_texts.scope(identity.tenant_id,
                                        salt if isinstance(salt, str) else "")
        parsed = parse(body, opts, seen, known, keep_history)
    models = state.pool.models()
    if parsed.model not in models:
        if not state.pool.any_healthy():
            raise NoWorkerAvailable("no healthy worker right now; retry shortly")
        raise ModelNotFound(
            f"the model {parsed.model[:200]!r} does not exist; available: "
            f"{', '.join(sorted(models))}",
            param="model",
        )
    tenant = identity.tenant_id  # a keyed hash: what Redis and the fingerprints see
    # The cache namespace the workers see: the tenant's, split further by the client's salt.
    namespace = app[AUTH_KEY].hasher.namespace(tenant, parsed.cache_salt)
    tokenized = None
    # Token-exact keys for completions and chats; a Responses request's are its chat's, the
    # prompt the engine runs (a next turn by previous_response_id runs after a stored
    # conversation its body does not carry: it goes where that is, by its pin).
    if state.exact.tokenizer is not None:
        tokenized = await state.exact.key(
            as_chat_body(parsed.body) if path == RESPONSES_PATH else parsed.body,
            chat=path != "/v1/completions", tenant=namespace, cache_salt=parsed.cache_salt,
        )
    block_tokens = 0
    prompt_tokens, cost = request_cost(parsed, settings)
    if tokenized is not None:  # token-exact: the blocks the engine will cache
        key, block_tokens = tokenized.key, tokenized.block_size
        if parsed.sequences == 1:
            cost += tokenized.tokens - prompt_tokens
            prompt_tokens = tokenized.tokens
    else:
        # The model's version is part of the namespace: prefixes of an old model never match.
        key = state.fingerprints.fingerprint(
            parsed.fingerprint_text,
            Namespace(tenant=tenant, model=state.pool.model_identity(parsed.model),
                      cache_salt=parsed.cache_salt),
            settings.fingerprint_options())
    route_request = RouteRequest(
        key=key, model=parsed.model, cost_tokens=cost, prompt_tokens=prompt_tokens,
        block_tokens=block_tokens,
    )
    return parsed, route_request, namespace


def admit_unread(request: web.Request) -> tuple[Identity, BodyHold]:
    """The caller's identity and its body's share of the body budget, for a request that may
    go on: what its tenant's limits refuse whatever it costs, a declared body over
    ``--max-body-bytes`` and one the budget cannot hold now are refused before the body is
    read. Release the hold once the request is answered."""
    settings = request.app[STATE].settings
    identity = request.get(IDENTITY_KEY) or ANONYMOUS
    limits = request.app[LIMITS_KEY]
    limits.check(identity.tenant)
    declared = request.content_length
    if declared is not None and declared > settings.max_body_bytes:
        raise PayloadTooLarge(
            f"request body too large: {declared} bytes, at most {settings.max_body_bytes}")
    return identity, limits.bodies.hold(declared)


async def _routed(request: web.Request, path: str, parse: Parser) -> web.StreamResponse:
    identity, hold = admit_unread(request)
    try:
        return await _held(request, path, parse, identity, hold)
    finally:
        hold.release()


async def _held(
    request: web.Request, path: str, parse: Parser, identity: Identity, hold: BodyHold
) -> web.StreamResponse:
    """:func:`_routed` for a request that holds its share of the body budget."""
    app = request.app
    state = app[STATE]
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s, hold)
    histories = (state.chat_histories if parse is parse_chat else
                 state.response_histories if parse is parse_responses else None)
    prompts = state.prompt_histories
    scope = found = prompt_scope = known_prompt = None
    if histories is not None and histories.max_bytes and len(raw) >= histories.min_bytes:
        # A long chat's turn (its messages, or a Responses request's input items) decodes
        # and checks only what its last turn did not carry.
        scope = histories.seed(identity.tenant_id, settings.normalize_options())
        body, found = histories.decode(raw, scope)
    elif parse is parse_completion and prompts.max_bytes and len(raw) >= prompts.min_bytes:
        # A long prompt's next turn decodes only what it adds to the last.
        prompt_scope = prompts.seed(identity.tenant_id, settings.normalize_options())
        body, known_prompt = prompts.decode(raw, prompt_scope)
    else:
        body = decode_json_object(raw)
    known: KnownHistory | NormalPrefix | None = None
    if found is not None:
        known = found.history
    elif known_prompt is not None:
        known = known_prompt.normal
    # A body of very many items (not known from an earlier turn) is parsed off the loop.
    on_thread = state.parse_pool.wants(
        body, len(raw), len(found.history.normalized) if found is not None else 0)
    if on_thread:
        known = scope = prompt_scope = None
    parsed, route_request, namespace = await prepare(
        app, body, parse, path, identity, known,
        keep_history=scope is not None or prompt_scope is not None, on_thread=on_thread)
    if scope is not None and histories is not None and parsed.history is not None:
        histories.remember(raw, scope, body, parsed.history, found)
    elif prompt_scope is not None:
        prompts.remember(raw, prompt_scope, body, known_prompt, parsed.normal)
    tenant = identity.tenant_id
    # A next turn that names a stored response goes where it is stored, and nowhere else.
    previous = body.get("previous_response_id") if path == RESPONSES_PATH else None
    only = (await state.pins.continued_on(state.pool, tenant, previous)
            if isinstance(previous, str) and state.pins.enabled else None)
    record = record_of(request)
    record.parsed(
        tenant=tenant, model=parsed.model, stream=body.get("stream") is True,
        text_hash=prompt_head_hash(parsed.fingerprint_text, settings.block_chars
                                   * settings.anchor_blocks),
        namespace=Namespace(tenant=tenant, model=parsed.model,
                            cache_salt=parsed.cache_salt).seed(),
    )
    # Hashes only: lets prompts a worker exports be keyed for this tenant (gateway.warmup).
    state.warmup.namespaces.seen(namespace, tenant)
    if state.warmup.sample.samples(identity.tenant):  # opt-in: in this process's memory only
        # Token-exact keys are not re-derived from text: the sample keeps the key as it is.
        text = "" if route_request.block_tokens else parsed.fingerprint_text
        state.warmup.observe(WarmPrompt(path, parsed.body, tenant, parsed.model,
                                        route_request.key, text=text,
                                        cache_salt=parsed.cache_salt,
                                        namespace=namespace), identity.tenant)
    upstream = UpstreamRequest(
        path=path, body=forwarded_body(parsed, raw),
        # The request's cache namespace: our worker keys its cache by it, vLLM gets it as
        # cache_salt.
        namespace=namespace, anchor=route_request.key.anchor_hex,
    )
    # While it waits for its place and its worker, a request holds only what it forwards
    # (the body as decoded, with the client's bytes where they are forwarded): its parse
    # (the rendered prompt text, a chat's history) goes now.
    del body, parsed, raw
    async with app[LIMITS_KEY].admitted(identity.tenant, route_request.cost_tokens):
        return await dispatch(state, request, record, upstream, route_request, tenant, only)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _routed(request, "/v1/completions", parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _routed(request, "/v1/chat/completions", parse_chat)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _routed(request, RESPONSES_PATH, parse_responses)


async def list_models(request: web.Request) -> web.Response:
    models = sorted(request.app[STATE].pool.models())
    return web.json_response(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "affinity-gateway"}
                for m in models
            ],
        }
    )


async def get_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    if model not in request.app[STATE].pool.models():
        raise ModelNotFound(f"the model {model!r} does not exist", param="model")
    return web.json_response(
        {"id": model, "object": "model", "created": 0, "owned_by": "affinity-gateway"}
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[STATE].pool
    healthy = sum(1 for s in pool.states() if s.healthy)
    status = 200 if healthy else 503
    return web.json_response(
        {"ready": healthy > 0, "healthy_workers": healthy, "workers": len(pool.states())},
        status=status,
    )


async def metrics(request: web.Request) -> web.Response:
    payload = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def admin_workers(request: web.Request) -> web.Response:
    state = request.app[STATE]
    workers = []
    now = time.monotonic()
    for s in state.pool.states():
        warmup = state.warmup.status.get(s.worker.id)
        workers.append(
            {
                "id": s.worker.id,
                "url": s.worker.url,
                "healthy": s.healthy,
                "models": sorted(s.worker.models),
                "inflight_requests": s.inflight_requests,
                "inflight_tokens": s.inflight_tokens,
                "routed": s.routed,
                "input_tokens": s.input_tokens,
                "matched_tokens": s.matched_tokens,
                "hit_ratio": s.matched_tokens / s.input_tokens if s.input_tokens else 0.0,
                "last_error": s.last_error,
                "breaker": state.guard.breakers.state(s.worker.id, now),
                "kind": s.worker.kind,
                # The data-parallel engine rank it is behind its URL (null: the whole server).
                "rank": s.worker.rank,
                # How it joined: static (--worker), registry (the store), kubernetes (a pod).
                "source": s.source,
                # The engine, as its model listing names itself ("" unknown): whether it is
                # asked about the copies' priority (gateway.contracts.engine_owners).
                "engine": s.engine,
                "engine_metrics": dict(s.engine_metrics),
                "scraped_at": s.scraped_at,  # the gateway's monotonic clock, seconds
                # Requests of this gateway in flight there at that scrape (the engine's
                # count beyond them is load from elsewhere).
                "own_at_scrape": s.own_at_scrape,
                # The engine's mean time to first token for the requests it started between
                # its last two scrapes (null: it does not say); under quick_first_token_s
                # the hard load bound does not apply to it.
                "first_token_s": s.first_token_s,
                # The prefix index's model of its cache: size (0 = unknown) and blocks held.
                "capacity_blocks": s.capacity_blocks,
                "modelled_blocks": state.index.held_blocks(s.worker.id),
                # Where routing learns what it caches: its KV events, or the model above.
                "cache_source": state.exact.source_of(s.worker.id),
                "kv_events": state.exact.describe(s.worker.id),
                # Of the responses whose cached tokens were predicted: how many exactly, how
                # many over (the engine had evicted what the index still modelled: a few
                # tokens at a cached prefix's tail when its pool held other requests' blocks,
                # a whole prefix when an entry was stale) and under, with the tokens off.
                "predictions": {"responses": s.predictions, "exact": s.predicted_exactly,
                                "over": s.predicted_over, "under": s.predicted_under,
                                "over_tokens": s.over_tokens, "under_tokens": s.under_tokens},
                # down / warming (left out of routing, or its weight still ramping) / serving
                "state": _worker_phase(s.healthy, warmup),
                "warmup": warmup.as_dict() if warmup is not None else None,
                "versions": dict(s.versions),
            }
        )
    return web.json_response(
        {"policy": state.session.router.name, "index_blocks": len(state.index),
         "workers": workers, "tokenizer": state.exact.tokenizer_stats(),
         "warming": sorted(state.warmup.warming()),
         # Session copies' engine priority (0: none sent), the workers whose engine takes
         # it and those that refuse it (first-come-first-served scheduling: their copies go
         # without one); a worker in neither has not answered the question yet.
         "prewarm": {**state.prewarmer.stats(),
                     "copy_priority": state.prewarmer.options.copy_priority,
                     "copy_priority_taken": state.warmup.with_priority,
                     "copy_priority_refused": state.warmup.no_priority},
         # The model and version each served model's prompts are fingerprinted under.
         "namespaces": {m: state.pool.model_identity(m) for m in sorted(state.pool.models())},
         # Kubernetes pod discovery (null without --k8s-selector).
         "discovery": (discovery.status() if (discovery := request.app.get(DISCOVERY_KEY))
                       is not None else None)}
    )


def _worker_phase(healthy: bool, warmup: WarmupStatus | None) -> str:
    if not healthy:
        return "down"
    return "warming" if warmup is not None and warmup.warming else "serving"



async def admin_rebalance(request: web.Request) -> web.Response:
    state = request.app[STATE]
    store, sync, rebalancer = (
        request.app[STORE_KEY], request.app[SYNC_KEY], request.app[REBALANCER_KEY])
    telemetry = await _or_none(store.read_telemetry())
    actions = await _or_none(store.recent_actions(50))
    return web.json_response(
        {
            "replica": sync.origin,
            "store": store.url,
            "store_available": sync.health.available,
            "leader": rebalancer.leading,
            "rounds": rebalancer.rounds,
            # The other processes of this gateway (--procs N) and the decisions exchanged
            # (sent: once per other process).
            "peers": _peer_stats(sync.peers),
            "actions": actions if actions is not None else [],
            "workers": {
                s.worker.id: {
                    "weight": s.worker.weight,
                    "capacity_blocks": state.index.capacity(s.worker.id),
                    "held_blocks": state.index.held_blocks(s.worker.id),
                    "telemetry": (
                        telemetry.workers[s.worker.id].as_dict()
                        if telemetry is not None and s.worker.id in telemetry.workers
                        else None
                    ),
                }
                for s in state.pool.states()
            },
        }
    )


def _peer_stats(link: PeerLink | None) -> dict[str, int] | None:
    if link is None:
        return None
    return {"processes": len(link.peers), "sent": link.sent, "received": link.received,
            "deferred": link.deferred, "pending": link.pending, "dropped": link.dropped}


async def _or_none(call: Awaitable[T]) -> T | None:
    try:
        return await call
    except StoreUnavailable:
        return None


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[STATE].pool.models()))


# The routes the lean HTTP/1.1 path serves itself when their requests are plain
# (gateway.contracts.lean_http), by method and path: the relay's requests, and the probes and
# views clients ask for on the same connections. Their handlers read only what a LeanRequest
# carries; every other request goes through aiohttp's server.
LEAN_ROUTES: Mapping[tuple[str, str], Callable[[web.Request], Awaitable[web.StreamResponse]]] = (
    MappingProxyType({
        ("POST", "/v1/completions"): completions,
        ("POST", "/v1/chat/completions"): chat_completions,
        ("GET", "/health"): health,
        ("GET", "/ready"): ready,
        ("GET", "/v1/models"): list_models,
        ("GET", "/metrics"): metrics,
        ("GET", "/admin/workers"): admin_workers,
    }))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post(RESPONSES_PATH, responses)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/workers", admin_workers)
    app.router.add_get("/admin/rebalance", admin_rebalance)
    app.router.add_get("/openapi.json", openapi)
