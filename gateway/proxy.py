"""Send one routed request to a worker and relay its answer to the client.

The attempt loop: route, send, and if the worker cannot be reached or answers 429/5xx before any
byte went to the client, exclude it and route again (at most ``max_attempts`` workers). Once the
relay has started nothing is retried: a failure mid-stream ends the stream with an SSE error
event, so the client is never left with a silently truncated answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import aiohttp
from aiohttp import web

from gateway.backends.base import BackendUnavailable, UpstreamReply
from gateway.backends.openai_http import NAMESPACE_HEADER
from gateway.errors import NoWorkerAvailable, UpstreamError
from gateway.routing.types import Decision, NoCandidates, RouteRequest
from gateway.state import GatewayState
from gateway.store.base import CacheReport
from gateway.telemetry import reason_kind

log = logging.getLogger(__name__)

# Request-scoped: the tenant id the handler derived from the API key.
TENANT_KEY = web.RequestKey("tenant", str)

CACHE_HEADERS = (
    "x-cache-input-tokens",
    "x-cache-matched-tokens",
    "x-cache-matched-blocks",
    "x-cache-hit-ratio",
)
_USAGE_TAIL_BYTES = 8192
_RELAYED_HEADERS = ("Content-Type", "x-request-id", *CACHE_HEADERS)


def route_headers(decision: Decision, request: RouteRequest) -> dict[str, str]:
    """The ``x-route-*`` headers that explain a decision to the client.

    ``x-route-load`` is the chosen worker's in-flight tokens including this request and, for
    bounded policies, the most it may hold (its bound plus this request).
    """
    load = f"tokens={decision.worker.inflight_tokens + request.cost_tokens}"
    if decision.load_bound is not None:
        load += f";bound={math.floor(decision.load_bound + request.cost_tokens)}"
    return {
        "x-route-worker": decision.worker_id,
        "x-route-policy": decision.policy,
        "x-route-reason": decision.reason,
        "x-route-load": load,
        "x-prefix-anchor": request.key.anchor_hex,
        "x-prefix-match-blocks": str(decision.match_blocks),
    }


def _int_header(reply: UpstreamReply, name: str) -> int:
    try:
        return int(reply.headers.get(name, "0"))
    except ValueError:
        return 0


async def dispatch(
    state: GatewayState,
    http_request: web.Request,
    path: str,
    body: dict[str, object],
    route_request: RouteRequest,
) -> web.StreamResponse:
    settings = state.settings
    pool = state.pool
    excluded: set[str] = set()
    problems: list[str] = []
    forward = {"x-request-id": http_request.headers.get("x-request-id", "")}
    forward = {k: v for k, v in forward.items() if v}
    # A routing hint for backends that can use it (SageMaker: PrefixAwareId, sessions).
    forward["x-prefix-anchor"] = route_request.key.anchor_hex
    # The tenant's cache namespace: our worker keys its cache by it, vLLM gets it as cache_salt.
    tenant = http_request.get(TENANT_KEY, "")
    if tenant:
        forward[NAMESPACE_HEADER] = tenant
    for _ in range(settings.max_attempts):
        started = time.perf_counter()
        state.index.set_time(time.monotonic())
        try:
            decision = state.engine.route(route_request, pool.snapshot(), frozenset(excluded))
        except NoCandidates:
            break
        wid = decision.worker_id
        if state.engine.profile.uses_prefix_index:
            state.index.record(route_request.key.blocks, wid)
            state.sync.assigned(route_request.key.blocks, wid)
        state.metrics.decision_seconds.observe(time.perf_counter() - started)
        state.metrics.decisions.labels(decision.policy, reason_kind(decision.reason)).inc()
        pool.acquire(wid, route_request.cost_tokens)
        try:
            try:
                worker = decision.worker.worker
                reply = await state.backend_for(worker).open(worker, path, body, forward)
            except BackendUnavailable as exc:
                pool.mark_down(wid, str(exc))
                problems.append(f"{wid}: {exc}")
            else:
                if reply.status != 429 and reply.status < 500:
                    state.metrics.requests.labels(decision.policy, str(reply.status)).inc()
                    return await _relay(state, http_request, reply, decision, route_request)
                detail = (await reply.read())[:200].decode("utf-8", "replace")
                reply.release()
                problems.append(f"{wid}: HTTP {reply.status} {detail}")
            excluded.add(wid)
            state.metrics.retries.labels(wid).inc()
            # It never got the prompt: it holds no more of this prefix than it did before.
            state.index.forget(wid, route_request.key.blocks[decision.match_blocks :])
        finally:
            pool.release(wid, route_request.cost_tokens)
    state.metrics.requests.labels(state.engine.name, "unavailable").inc()
    if not problems:
        raise NoWorkerAvailable("no healthy worker serves this request right now; retry shortly")
    log.warning("request failed on every worker tried: %s", "; ".join(problems))
    raise UpstreamError(
        f"{len(problems)} worker(s) failed this request before replying: " + "; ".join(problems)
    )


def stats_from_headers(reply: UpstreamReply) -> tuple[int, int] | None:
    """(input tokens, matched tokens) from our worker's ``x-cache-*`` headers."""
    input_tokens = _int_header(reply, "x-cache-input-tokens")
    return (input_tokens, _int_header(reply, "x-cache-matched-tokens")) if input_tokens else None


def stats_from_usage(payload: bytes) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from an OpenAI ``usage`` (vLLM fills
    ``prompt_tokens_details.cached_tokens``), in a JSON body or the tail of an SSE stream."""
    for line in reversed(payload.splitlines()):
        line = line.removeprefix(b"data:").strip()
        if not line.startswith(b"{") or b'"usage"' not in line:
            continue
        try:
            usage = json.loads(line).get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            prompt = int(usage.get("prompt_tokens") or 0)
            cached = int(details.get("cached_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            return None
        return (prompt, cached) if prompt > 0 else None
    return None


def report_cache(
    state: GatewayState,
    http_request: web.Request,
    decision: Decision,
    route_request: RouteRequest,
    stats: tuple[int, int] | None,
) -> None:
    """Count what the worker reused, against what the index predicted it would."""
    if stats is None:
        return  # this worker reports nothing we can read
    input_tokens, matched = stats
    state.pool.record_cache_stats(decision.worker_id, input_tokens, matched)
    blocks = len(route_request.key.blocks)
    predicted = round(input_tokens * decision.match_blocks / blocks) if blocks else 0
    state.sync.reported(CacheReport(
        worker_id=decision.worker_id,
        tenant=http_request.get(TENANT_KEY, ""),
        input_tokens=input_tokens,
        matched_tokens=matched,
        predicted_tokens=predicted,
    ))


async def _relay(
    state: GatewayState,
    http_request: web.Request,
    reply: UpstreamReply,
    decision: Decision,
    route_request: RouteRequest,
) -> web.StreamResponse:
    headers = route_headers(decision, route_request)
    for name in _RELAYED_HEADERS:
        value = reply.headers.get(name)
        if value is not None:
            headers[name] = value
    stats = stats_from_headers(reply)
    content_type = reply.headers.get("Content-Type", "")
    if not content_type.startswith("text/event-stream"):
        try:
            payload = await reply.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"{decision.worker_id} broke off its reply: {exc}") from exc
        finally:
            reply.release()
        if stats is None and reply.status == 200:
            stats = stats_from_usage(payload)
        report_cache(state, http_request, decision, route_request, stats)
        return web.Response(body=payload, status=reply.status, headers=headers)
    response = web.StreamResponse(status=reply.status, headers=headers)
    await response.prepare(http_request)
    tail = b""  # the end of the stream, where a final usage chunk sits
    try:
        async for chunk in reply.chunks():
            await response.write(chunk)
            if stats is None:
                tail = (tail + chunk)[-_USAGE_TAIL_BYTES:]
    except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError) as exc:
        log.warning("stream from %s broke off: %s", decision.worker_id, exc)
        error = {
            "error": {
                "message": f"the worker {decision.worker_id} broke off the stream: {exc}",
                "type": "upstream_error",
                "param": None,
                "code": "stream_interrupted",
            }
        }
        await response.write(f"data: {json.dumps(error)}\n\n".encode())
    finally:
        reply.release()
    report_cache(state, http_request, decision, route_request, stats or stats_from_usage(tail))
    await response.write_eof()
    return response
