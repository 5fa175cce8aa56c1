"""Send one routed request to a worker and relay its answer to the client.

The attempt loop: route, send, and if the worker cannot be reached or answers 429/5xx before any
byte went to the client, exclude it and route again (at most ``max_attempts`` workers; after a
429 or 503 it first waits a short jittered backoff, 50 ms doubling up to 1 s). Once the
relay has started nothing is retried: a failure mid-stream ends the stream with an SSE error
event, so the client is never left with a silently truncated answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from gateway.backends.base import BackendUnavailable, UpstreamReply
from gateway.backends.openai_http import NAMESPACE_HEADER
from gateway.errors import NoWorkerAvailable, UpstreamError
from gateway.kvevents.index import ExactMatcher
from gateway.routing.types import Decision, NoCandidates, RouteRequest, Snapshot
from gateway.state import GatewayState
from gateway.store.base import CacheReport
from gateway.telemetry import reason_kind
from gateway.telemetry.middleware import record_of

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
_FIRST_BACKOFF_S = 0.05  # before retrying elsewhere after a 429/503; doubles, jittered
_MAX_BACKOFF_S = 1.0
_RELAYED_HEADERS = ("Content-Type", *CACHE_HEADERS)
# Our worker's boot id: a new value means it restarted with a cold cache.
WORKER_BOOT_HEADER = "x-worker-boot-id"


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
    observed = record_of(http_request)  # telemetry; it adds the request id and trace context
    forward: dict[str, str] = {}
    # A routing hint for backends that can use it (SageMaker: PrefixAwareId, sessions).
    forward["x-prefix-anchor"] = route_request.key.anchor_hex
    # The tenant's cache namespace: our worker keys its cache by it, vLLM gets it as cache_salt.
    tenant = http_request.get(TENANT_KEY, "")
    if tenant:
        forward[NAMESPACE_HEADER] = tenant
    backoff_s = 0.0
    for _ in range(settings.max_attempts):
        if backoff_s:
            # The last worker was busy (429/503): give the pool a moment before the next one.
            await asyncio.sleep(backoff_s * (0.5 + random.random()))
        started = time.perf_counter()
        now = time.monotonic()
        state.index.set_time(now)
        snapshot = pool.snapshot()
        try:
            decision = state.engine.route(route_request, snapshot, frozenset(excluded))
        except NoCandidates:
            break
        wid = decision.worker_id
        predicted = predicted_tokens(snapshot, route_request, decision)
        uses_index = state.engine.profile.uses_prefix_index
        observed.decided(decision, route_request, snapshot.index if uses_index else None, started)
        if uses_index:
            state.index.record(route_request.key.blocks, wid)
            state.sync.assigned(route_request.key.blocks, wid)
            state.exact.sent(wid, route_request.key.blocks, now)
            state.prewarmer.after_route(decision, route_request, path, body, tenant)
        state.metrics.decision_seconds.observe(time.perf_counter() - started)
        state.metrics.decisions.labels(decision.policy, reason_kind(decision.reason)).inc()
        pool.acquire(wid, route_request.cost_tokens)
        try:
            try:
                worker = decision.worker.worker
                reply = await state.backend_for(worker).open(
                    worker, path, body, observed.upstream_headers(forward))
            except BackendUnavailable as exc:
                observed.upstream_done(None, str(exc))
                pool.mark_down(wid, str(exc))
                problems.append(f"{wid}: {exc}")
            else:
                if reply.status != 429 and reply.status < 500:
                    if _is_stream(reply):
                        state.metrics.requests.labels(decision.policy, str(reply.status)).inc()
                        return await _relay_stream(
                            state, http_request, reply, decision, route_request, predicted)
                    payload = await _read_whole(reply)
                    observed.upstream_done(reply.status if payload is not None else None,
                                           "" if payload is not None else "broke off")
                    if payload is not None:
                        state.metrics.requests.labels(decision.policy, str(reply.status)).inc()
                        return _respond_whole(
                            state, http_request, reply, payload, decision, route_request,
                            predicted)
                    # It broke off before the client saw a byte: try the next worker.
                    pool.mark_down(wid, "the connection broke off during its reply")
                    problems.append(f"{wid}: broke off its reply")
                else:
                    detail = ((await _read_whole(reply)) or b"")[:200].decode("utf-8", "replace")
                    observed.upstream_done(reply.status)
                    problems.append(f"{wid}: HTTP {reply.status} {detail}")
                    if reply.status in (429, 503):
                        backoff_s = min(max(2 * backoff_s, _FIRST_BACKOFF_S), _MAX_BACKOFF_S)
            excluded.add(wid)
            state.metrics.retries.labels(wid).inc()
            # It never got the prompt: it holds no more of this prefix than it did before.
            state.index.forget(wid, route_request.key.blocks[decision.match_blocks :])
            state.exact.unsent(wid, route_request.key.blocks[decision.match_blocks :])
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


def predicted_tokens(snapshot: Snapshot, request: RouteRequest, decision: Decision) -> int | None:
    """Prompt tokens the chosen worker should find cached: with token-exact keys, the leading
    blocks its index source says it holds (not floored by the policy's minimum match; for vLLM
    never the whole prompt); None with character keys, whose prediction is scaled from the
    reply (:func:`report_cache`)."""
    if not request.block_tokens:
        return None
    index, wid = snapshot.index, decision.worker_id
    if isinstance(index, ExactMatcher):
        depth = index.held(wid, request.key.blocks)
    else:
        depth = index.match(request.key.blocks).get(wid, 0)
    if decision.worker.worker.kind == "vllm":
        # vLLM computes at least the last prompt token: a fully cached prompt reports one
        # block less.
        depth = min(depth, max(0, request.prompt_tokens - 1) // request.block_tokens)
    return depth * request.block_tokens


def report_cache(
    state: GatewayState,
    http_request: web.Request,
    decision: Decision,
    route_request: RouteRequest,
    stats: tuple[int, int] | None,
    predicted: int | None = None,
    reply: UpstreamReply | None = None,
) -> None:
    """Count what the worker reused, against what the index predicted it would."""
    if stats is None:
        return  # this worker reports nothing we can read
    input_tokens, matched = stats
    boot_id = reply.headers.get(WORKER_BOOT_HEADER, "") if reply is not None else ""
    record_of(http_request).cache_reported(input_tokens, matched, boot_id)
    state.pool.record_cache_stats(decision.worker_id, input_tokens, matched)
    if predicted is None:
        blocks = len(route_request.key.blocks)
        predicted = round(input_tokens * decision.match_blocks / blocks) if blocks else 0
    state.pool.record_prediction(decision.worker_id, predicted, matched)
    state.sync.reported(CacheReport(
        worker_id=decision.worker_id,
        tenant=http_request.get(TENANT_KEY, ""),
        input_tokens=input_tokens,
        matched_tokens=matched,
        predicted_tokens=predicted,
    ))


def _is_stream(reply: UpstreamReply) -> bool:
    return reply.headers.get("Content-Type", "").startswith("text/event-stream")


async def _read_whole(reply: UpstreamReply) -> bytes | None:
    """The whole body, or None if the worker broke off while sending it."""
    try:
        return await reply.read()
    except (aiohttp.ClientError, TimeoutError):
        return None
    finally:
        reply.release()


def _client_headers(decision: Decision, route_request: RouteRequest,
                    reply: UpstreamReply) -> dict[str, str]:
    headers = route_headers(decision, route_request)
    for name in _RELAYED_HEADERS:
        value = reply.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


def _respond_whole(
    state: GatewayState,
    http_request: web.Request,
    reply: UpstreamReply,
    payload: bytes,
    decision: Decision,
    route_request: RouteRequest,
    predicted: int | None,
) -> web.Response:
    stats = stats_from_headers(reply)
    if stats is None and reply.status == 200:
        stats = stats_from_usage(payload)
    report_cache(state, http_request, decision, route_request, stats, predicted, reply)
    return web.Response(
        body=payload, status=reply.status,
        headers=_client_headers(decision, route_request, reply),
    )


async def _relay_stream(
    state: GatewayState,
    http_request: web.Request,
    reply: UpstreamReply,
    decision: Decision,
    route_request: RouteRequest,
    predicted: int | None,
) -> web.StreamResponse:
    headers = _client_headers(decision, route_request, reply)
    stats = stats_from_headers(reply)
    response = web.StreamResponse(status=reply.status, headers=headers)
    tail = b""  # the end of the stream, where a final usage chunk sits
    observed = record_of(http_request)
    broke_off = ""
    try:
        # Inside the try: if the client is already gone, the upstream reply is still released.
        await response.prepare(http_request)
        async for chunk in _upstream_chunks(reply, decision.worker_id):
            observed.first_byte()
            await response.write(chunk)
            if stats is None:
                tail = (tail + chunk)[-_USAGE_TAIL_BYTES:]
    except _UpstreamBrokeOff as exc:
        broke_off = f"broke off: {exc}"
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
        # A reply not read to its end closes its connection: the worker sees its client leave.
        reply.release()
    observed.upstream_done(reply.status, broke_off)
    # A usage event the backend held back from the client (it asked for it on our behalf).
    tail += getattr(reply, "withheld", b"")
    report_cache(state, http_request, decision, route_request, stats or stats_from_usage(tail),
                 predicted, reply)
    await response.write_eof()
    return response


class _UpstreamBrokeOff(Exception):
    """The worker's side of a relayed stream failed (the client's side raises as it is)."""


async def _upstream_chunks(reply: UpstreamReply, worker_id: str) -> AsyncIterator[bytes]:
    chunks = reply.chunks()
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("stream from %s broke off: %s", worker_id, exc)
            raise _UpstreamBrokeOff(str(exc)) from exc
        yield chunk
