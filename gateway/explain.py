"""Operator views of routing: ``POST /admin/explain`` (a dry run) and ``GET /admin/misses``.

``/admin/explain`` takes a completion or chat request body (a body with ``messages`` is a chat;
``?kind=chat|completion`` says so explicitly) with the caller's ``Authorization`` header (its
key's tenant is the one explained), and
answers, without sending anything to a worker or recording anything in the prefix index, the
request's fingerprint, every worker's match, load and estimated cost, and the decision the
policy would take now. (A round-robin policy's turn does advance.) No prompt text is echoed.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from aiohttp import web

from gateway.api import STATE, Parser, prepare
from gateway.auth import ANONYMOUS, AUTH_KEY, Unauthorized
from gateway.errors import InvalidRequest
from gateway.openai_schema import decode_json_object, parse_chat, parse_completion
from gateway.resources import SYNC_KEY
from gateway.routing.types import NoCandidates
from gateway.telemetry.middleware import TELEMETRY_KEY

_PARSERS: dict[str, Parser] = {"chat": parse_chat, "completion": parse_completion}


async def explain(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode_json_object(await request.read())
    kind = request.query.get("kind") or ("chat" if "messages" in body else "completion")
    parse = _PARSERS.get(kind)
    if parse is None:
        raise InvalidRequest("kind must be chat or completion", param="kind")
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    # The tenant (and so the fingerprint's namespace) of the key in Authorization, exactly as
    # the /v1 route would see it; an admin token there explains the request as the keyless one.
    identity = ANONYMOUS
    with contextlib.suppress(Unauthorized):
        identity = request.app[AUTH_KEY].identify(request)
    parsed, route_request, _ = await prepare(request.app, body, parse, path, identity)
    router = state.session.router
    snapshot = state.pool.snapshot(time.monotonic())
    key = route_request.key
    blocks = key.total_blocks
    raw = snapshot.index.match(key.blocks) if router.uses_prefix_index else {}
    matches = {wid: key.depth_at(count - 1) for wid, count in raw.items()}  # in blocks
    try:
        decision = router.route(route_request, snapshot)
    except NoCandidates as exc:
        decision_view: dict[str, Any] = {"worker": None, "reason": str(exc) or "no candidates"}
        scores: dict[str, float] = {}
    else:
        scores = dict(decision.scores)
        decision_view = {
            "worker": decision.worker_id,
            "policy": decision.policy,
            "kind": decision.label,
            "reason": decision.reason,
            "match_blocks": decision.match_blocks,
            "load_bound_tokens": decision.load_bound,
        }
    settings = state.settings
    prompt = route_request.prompt_tokens
    candidates = []
    for view in snapshot.workers:
        match = matches.get(view.id, 0)
        uncached = round(prompt * (1.0 - match / blocks)) if blocks else prompt
        candidates.append({
            "worker": view.id,
            "healthy": view.healthy,
            "serves_model": view.worker.serves(parsed.model),
            "match_blocks": match,
            "inflight_requests": view.inflight_requests,
            "inflight_tokens": view.inflight_tokens,
            "uncached_prompt_tokens": uncached,
            # cache_aware's cost: prefill of what is not cached plus the queue ahead of it.
            "cost": settings.prefill_weight * uncached
            + settings.queue_weight * view.inflight_tokens,
            "score": scores.get(view.id),
        })
    return web.json_response({
        "dry_run": True,
        # Which gateway answered: a replica, or one of the processes of --procs N.
        "replica": request.app[SYNC_KEY].origin,
        "fingerprint": {
            "kind": kind,
            "model": parsed.model,
            "blocks": blocks,
            "block_chars": settings.block_chars,
            "anchor": key.anchor_hex,
            "first_blocks": [f"{h:016x}" for h in key.blocks[:4]],
            "prompt_tokens_estimate": prompt,
            "cost_tokens": route_request.cost_tokens,
        },
        "decision": decision_view,
        "candidates": candidates,
    })


async def misses(request: web.Request) -> web.Response:
    tracker = request.app[TELEMETRY_KEY].misses
    try:
        limit = int(request.query.get("limit", "50"))
    except ValueError as exc:
        raise InvalidRequest("limit must be an integer", param="limit") from exc
    if not 0 <= limit <= 200:
        raise InvalidRequest("limit must be between 0 and 200", param="limit")
    return web.json_response({
        "requests": tracker.requests,
        "by_worker": tracker.counts(),
        "recent": [m.as_dict() for m in tracker.recent(limit)],
    })


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/explain", explain)
    app.router.add_get("/admin/misses", misses)
