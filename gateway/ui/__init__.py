"""The live status page: ``GET /ui`` (one self-contained HTML file: inline CSS and JS, no CDN,
no external fonts) and ``GET /ui/data`` (the JSON it polls every two seconds).

The page shows the workers (health, load, modelled cache fill, hit rate, their engine's time to
first token, misses), the hit rate and latency over the last ten minutes, routing decisions by
kind, the recent misses with their diagnosed cause, and the rebalancer's actions. No prompt
text is ever part of the data.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from aiohttp import web

from gateway.api import STATE
from gateway.resources import STORE_KEY, SYNC_KEY
from gateway.store.base import StoreUnavailable
from gateway.telemetry.middleware import TELEMETRY_KEY

PAGE_KEY = web.AppKey("ui_page", bytes)


def _page() -> bytes:
    return resources.files(__package__).joinpath("status.html").read_bytes()


async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[PAGE_KEY], content_type="text/html", charset="utf-8",
        headers={"Cache-Control": "no-cache",
                 # Everything is inline; nothing may be fetched from elsewhere.
                 "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                 "script-src 'unsafe-inline'; img-src 'self' data:"},
    )


async def data(request: web.Request) -> web.Response:
    state = request.app[STATE]
    store, sync = request.app[STORE_KEY], request.app[SYNC_KEY]
    telemetry = request.app[TELEMETRY_KEY]
    misses = telemetry.misses
    by_worker = misses.counts()
    workers: list[dict[str, Any]] = []
    input_total = matched_total = 0
    for s in state.pool.states():
        wid = s.worker.id
        capacity = state.index.capacity(wid) if s.capacity_blocks else 0
        held = state.index.held_blocks(wid)
        input_total += s.input_tokens
        matched_total += s.matched_tokens
        workers.append({
            "id": wid,
            "healthy": s.healthy,
            "kind": s.worker.kind,
            "inflight_requests": s.inflight_requests,
            "inflight_tokens": s.inflight_tokens,
            "routed": s.routed,
            "cache_fill": held / capacity if capacity else None,
            "held_blocks": held,
            "hit_rate": s.matched_tokens / s.input_tokens if s.input_tokens else None,
            # The engine's mean time to first token between its last two scrapes (None: it
            # does not say); under quick_first_token_s cache_aware's hard bound spares it.
            "first_token_ms": None if s.first_token_s is None else 1e3 * s.first_token_s,
            "misses": sum(by_worker.get(wid, {}).values()),
            "last_error": s.last_error,
        })
    by_cause: dict[str, int] = {}
    for causes in by_worker.values():
        for cause, n in causes.items():
            by_cause[cause] = by_cause.get(cause, 0) + n
    try:
        actions = await store.recent_actions(20)
    except StoreUnavailable:
        actions = []
    now = time.time()
    return web.json_response({
        "now": now,
        "policy": state.session.router.name,
        "replica": sync.origin,
        "store": {"url": store.url, "available": sync.health.available},
        "bucket_s": telemetry.window.bucket_s,
        "totals": {
            "requests": sum(w["routed"] for w in workers),
            "hit_rate": matched_total / input_total if input_total else None,
            "misses": sum(by_cause.values()),
            "diagnosed": misses.requests,
        },
        "workers": workers,
        "series": telemetry.window.series(now),
        "decisions": telemetry.window.decision_totals(),
        "misses": {"by_cause": by_cause, "recent": [m.as_dict() for m in misses.recent(20)]},
        "actions": actions,
    }, headers={"Cache-Control": "no-cache"})


def add_routes(app: web.Application) -> None:
    app[PAGE_KEY] = _page()
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/", page)
    app.router.add_get("/ui/data", data)
