"""Send one routed request to a worker and relay its answer to the client.

The attempt loop: route (around workers whose circuit breaker is open), send, and if the worker
cannot be reached, sends nothing before the first-byte timeout, is found down while we wait, or
answers 429/5xx before any byte went to the client, exclude it and route again (at most
``max_attempts`` workers; after a 429 or 503 it first waits a short jittered backoff, 50 ms
doubling up to 1 s). Once the
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
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from gateway.backends.base import (
    BackendUnavailable,
    UpstreamBrokeOff,
    UpstreamReply,
    UpstreamRequest,
)
from gateway.contracts.engine_paths import COMPLETION_PATHS
from gateway.contracts.errors import openai_error
from gateway.contracts.headers import (
    CACHE_STAT_HEADERS,
    ENGINE_COMPUTED_HEADER,
    ENGINE_DONE_HEADER,
    INPUT_TOKENS_HEADER,
    MATCHED_TOKENS_HEADER,
    WORKER_BOOT_HEADER,
)
from gateway.contracts.lean_http import lean_connection_of
from gateway.contracts.responses import RESPONSES_PATH, response_id_in, stores
from gateway.errors import ConnectionQueueFull, GatewayError, NoWorkerAvailable, UpstreamError
from gateway.guard import IdleTimer, NoFirstByte, SlotTimeout, UpstreamGuard
from gateway.routing.types import Decision, NoCandidates, RouteRequest
from gateway.session import Attempt, CacheUsage
from gateway.state import GatewayState
from gateway.telemetry.record import RequestRecord

log = logging.getLogger(__name__)

_USAGE_TAIL_BYTES = 8192
_ID_SEARCH_BYTES = 65536  # a Responses stream's id is in its first event, within this
_FIRST_BACKOFF_S = 0.05  # before retrying elsewhere after a 429/503; doubles, jittered
_MAX_BACKOFF_S = 1.0
_RELAYED_HEADERS = ("Content-Type", *CACHE_STAT_HEADERS, ENGINE_DONE_HEADER,
                    ENGINE_COMPUTED_HEADER)
# How a worker's reply can break off once its head came (the backends' own error, aiohttp's).
_BROKE_OFF = (UpstreamBrokeOff, aiohttp.ClientError, asyncio.IncompleteReadError)


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


async def dispatch(
    state: GatewayState,
    http_request: web.Request,
    observed: RequestRecord,
    upstream: UpstreamRequest,
    route_request: RouteRequest,
    tenant: str,
    only: str | None = None,
) -> web.StreamResponse:
    """Route ``upstream`` (of ``tenant``, the keyed id) and relay a worker's answer;
    ``observed`` is the request's telemetry record (it adds the request id and trace context
    to each attempt). ``only``: that worker or none (it holds the stored response the request
    continues). A Responses answer that may be stored is pinned to its worker
    (:mod:`gateway.response_pins`) before the client sees its id."""
    settings = state.settings
    session = state.session
    # Workers whose backend takes completions only (SageMaker endpoints) never get another path.
    excluded: set[str] = set() if upstream.path in COMPLETION_PATHS else {
        s.worker.id for s in state.pool.states()
        if not state.backend_for(s.worker).relays_engine_api}
    if only is not None:
        excluded.update(s.worker.id for s in state.pool.states() if s.worker.id != only)
    pin_answers = (upstream.path == RESPONSES_PATH and state.pins.enabled
                   and stores(upstream.body))
    problems: list[str] = []
    backoff_s = 0.0
    guard = state.guard
    busy = 0  # attempts that found no free connection to their worker
    uses_index = session.router.uses_prefix_index
    started = 0.0  # when the current attempt's decision began
    explained: dict[str, str] = {}  # the current attempt's x-route-* headers

    def account(attempt: Attempt, decided_s: float) -> None:
        """Record a decision (:meth:`RoutingSession.commit`) after its telemetry record,
        which reads the index as the decision saw it; then what follows it: a pre-warm of a
        hot prefix near its holder's bound, the decision's metrics, and the headers that
        explain it to the client (made while the worker computes, not on the client's
        time once it has answered)."""
        nonlocal explained
        if attempt.committed or attempt.settled:
            return
        observed.decided(attempt.decision, route_request,
                         attempt.index if uses_index else None, started, started + decided_s)
        session.commit(attempt)
        decision = attempt.decision
        if uses_index:
            attempt.prewarmed_to = state.prewarmer.after_route(
                decision, route_request, upstream, tenant, attempt.at) or ""
        state.metrics.decision_seconds.observe(decided_s)
        state.metrics.decisions.labels(decision.policy, decision.label).inc()
        explained = route_headers(decision, route_request)

    for _ in range(settings.max_attempts):
        if backoff_s:
            # The last worker was busy (429/503): give the pool a moment before the next one.
            await asyncio.sleep(backoff_s * (0.5 + random.random()))
        started = time.perf_counter()
        try:
            now = time.monotonic()
            blocked = frozenset(excluded) | guard.blocked(state.pool, now)
            attempt = session.decide(route_request, now, blocked, tenant,
                                     pinned="stored response" if only is not None else "")
        except NoCandidates:
            break
        decided_s = time.perf_counter() - started
        decision = attempt.decision
        wid = decision.worker_id
        guard.breakers.attempt(wid, now)
        release_slot = None
        handed_off = False
        try:
            try:
                # The request goes out before its decision is recorded, so the worker starts
                # on it meanwhile; nothing awaits in between, so no other request is decided
                # before this one is recorded (a wait for a connection records it first).
                release_slot = guard.slots.try_take(wid)
                if release_slot is None:
                    account(attempt, decided_s)
                    release_slot = await guard.slots.take(wid)
                worker = decision.worker.worker
                attempt_upstream = upstream.with_headers(observed.upstream_headers({}, wid))
                try:
                    opening = state.backend_for(worker).send(worker, attempt_upstream)
                finally:
                    account(attempt, decided_s)
                reply = await guard.open(wid, opening)
                guard.liveness.heard(wid, time.monotonic())
                opened = None
                stream = _is_stream(reply)
                if reply.status < 400 and stream:
                    # Engines send a stream's headers at once: nothing reached the client until
                    # the first chunk, so a worker silent until then loses the request too.
                    opened = await _first_chunk(reply, wid, guard)
            except SlotTimeout as exc:
                if exc.scope != wid:  # the gateway's own limit: no other worker helps
                    observed.upstream_done(None, str(exc))
                    raise ConnectionQueueFull(
                        f"the gateway is at its connection limit: {exc}") from None
                busy += 1
                observed.upstream_done(None, str(exc))
                problems.append(f"{wid}: {exc}")
            except NoFirstByte as exc:
                observed.upstream_done(None, str(exc))
                guard.breakers.failure(wid, time.monotonic())
                problems.append(f"{wid}: {exc}")
            except BackendUnavailable as exc:
                observed.upstream_done(None, str(exc))
                state.pool.mark_down(wid, str(exc))
                guard.breakers.failure(wid, time.monotonic())
                problems.append(f"{wid}: {exc}")
            else:
                if reply.status != 429 and reply.status < 500:
                    guard.breakers.success(wid)
                    pin = (_pinning(state, tenant, wid)
                           if pin_answers and reply.status == 200 else None)
                    if stream:
                        state.metrics.requests.labels(decision.policy, str(reply.status)).inc()
                        return await _relay_stream(state, http_request, observed, reply, attempt,
                                                   explained, opened, pin)
                    payload = await _read_whole(reply)
                    if payload is not None:
                        stored = response_id_in(payload) if pin is not None else None
                        if pin is not None and stored is not None:
                            await pin(stored)
                        handed_off = True  # settled once the answer is out (_respond_whole)
                        return _respond_whole(state, observed, reply, payload, attempt,
                                              explained)
                    observed.upstream_done(None, "broke off")
                    # It broke off before the client saw a byte: try the next worker.
                    state.pool.mark_down(wid, "the connection broke off during its reply")
                    guard.breakers.failure(wid, time.monotonic())
                    problems.append(f"{wid}: broke off its reply")
                else:
                    detail = ((await _read_whole(reply)) or b"")[:200].decode("utf-8", "replace")
                    observed.upstream_done(reply.status)
                    problems.append(f"{wid}: HTTP {reply.status} {detail}")
                    if reply.status in (429, 503):
                        backoff_s = min(max(2 * backoff_s, _FIRST_BACKOFF_S), _MAX_BACKOFF_S)
                    else:
                        guard.breakers.failure(wid, time.monotonic())
            excluded.add(wid)
            state.metrics.retries.labels(wid).inc()
            session.failed(attempt, time.monotonic())
        finally:
            if release_slot is not None:
                release_slot()
            guard.breakers.settled(wid)
            if not handed_off:
                # The client went away mid-relay: release the worker, with nothing to report.
                session.completed(attempt, now=time.monotonic())
    state.metrics.requests.labels(session.router.name, "unavailable").inc()
    if not problems and only is not None:
        raise NoWorkerAvailable(f"the worker that holds the previous response ({only}) is not "
                                "serving right now; retry shortly")
    if not problems:
        raise NoWorkerAvailable("no healthy worker serves this request right now; retry shortly")
    raise tried_everywhere(problems, busy, http_request.path)


def tried_everywhere(problems: list[str], busy: int, path: str) -> GatewayError:
    """The error once every worker tried failed a request before replying (``problems``: one
    line each; ``busy``: how many had no free connection): 503 when none had one, else 502."""
    if busy and busy == len(problems):
        return ConnectionQueueFull(
            "every worker tried is at its connection limit: " + "; ".join(problems))
    log.warning("%s failed on every worker tried: %s", path, "; ".join(problems))
    return UpstreamError(
        f"{len(problems)} worker(s) failed this request before replying: " + "; ".join(problems))


def _usage(input_tokens: int, matched_tokens: int) -> CacheUsage | None:
    """A worker's report as the routing takes it: none without prompt tokens, and cached
    tokens within ``[0, input_tokens]`` (a report outside it is a worker's bug, and must not
    drive the capacity fit or the hit counters past what can be)."""
    if input_tokens <= 0:
        return None
    return CacheUsage(input_tokens, min(max(matched_tokens, 0), input_tokens))


def stats_from_headers(reply: UpstreamReply) -> CacheUsage | None:
    """What our worker reused, from its ``x-cache-*`` headers."""
    headers = reply.headers
    try:
        input_tokens = int(headers.get(INPUT_TOKENS_HEADER, "0"))
    except ValueError:
        return None
    try:
        matched = int(headers.get(MATCHED_TOKENS_HEADER, "0"))
    except ValueError:
        matched = 0
    return _usage(input_tokens, matched)


def stats_from_usage(payload: bytes) -> CacheUsage | None:
    """Prompt and cached tokens from an OpenAI ``usage`` (vLLM fills
    ``prompt_tokens_details.cached_tokens``; a Responses answer ``input_tokens`` and
    ``input_tokens_details.cached_tokens``, in its response), in a JSON body or the tail of an
    SSE stream."""
    for line in reversed(payload.splitlines()):
        line = line.removeprefix(b"data:").strip()
        if not line.startswith(b"{") or b'"usage"' not in line:
            continue
        try:
            event = json.loads(line)
            # A Responses API answer: its usage in the response (the stream's last event).
            usage = event.get("usage") or (event.get("response") or {}).get("usage") or {}
            details = (usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
                       or {})
            prompt = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            cached = int(details.get("cached_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            return None
        return _usage(prompt, cached)
    return None


def _pinning(state: GatewayState, tenant: str,
             worker_id: str) -> Callable[[str], Awaitable[None]]:
    """What pins a response id of ``tenant`` to ``worker_id``."""
    def pin(response_id: str) -> Awaitable[None]:
        return state.pins.remember(tenant, response_id, worker_id)

    return pin


def _report(observed: RequestRecord, reply: UpstreamReply, usage: CacheUsage | None) -> None:
    """What the worker said it reused, for the request's telemetry record."""
    if usage is not None:
        boot_id = reply.headers.get(WORKER_BOOT_HEADER, "")
        observed.cache_reported(usage.input_tokens, usage.matched_tokens, boot_id)


def _is_stream(reply: UpstreamReply) -> bool:
    return reply.headers.get("Content-Type", "").startswith("text/event-stream")


async def _read_whole(reply: UpstreamReply) -> bytes | None:
    """The whole body, or None if the worker broke off while sending it."""
    try:
        return await reply.read()
    except (*_BROKE_OFF, TimeoutError):
        return None
    finally:
        reply.release()


def _client_headers(
    observed: RequestRecord, attempt: Attempt, reply: UpstreamReply, explained: dict[str, str]
) -> dict[str, str]:
    """The answer's headers: the decision's (``explained``: :func:`route_headers`, extended
    here) with the gateway's timing and what the worker's reply says of its cache."""
    headers = explained
    # Where the gateway's time went (W3C Server-Timing, milliseconds): from the request's
    # arrival to the decision that answered it, then to the worker's reply (its whole body;
    # a stream's first chunk).
    upstream = time.monotonic() - attempt.at
    wait = max(0.0, time.perf_counter() - observed.started - upstream)
    headers["Server-Timing"] = f"wait;dur={wait * 1e3:.3f}, upstream;dur={upstream * 1e3:.3f}"
    # The decision's instant on the gateway's monotonic clock (seconds): it orders and spaces
    # one gateway's decisions, as a replay of them needs; it means nothing on its own.
    headers["x-route-at"] = f"{attempt.at:.6f}"
    if attempt.prewarmed_to:  # this decision also pre-warmed its prefix there
        headers["x-route-prewarm"] = attempt.prewarmed_to
    for name in _RELAYED_HEADERS:
        value = reply.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


def _respond_whole(
    state: GatewayState,
    observed: RequestRecord,
    reply: UpstreamReply,
    payload: bytes,
    attempt: Attempt,
    explained: dict[str, str],
) -> web.Response:
    """The worker's whole answer, as the client gets it. What the worker reported reusing is
    read, and its attempt settled, once the answer is out (:meth:`RequestRecord.after_sent`):
    nothing in the answer depends on it, and the client need not wait for it."""
    answered, read_at = time.monotonic(), time.perf_counter()

    def settle() -> None:
        observed.upstream_done(reply.status, at=read_at)
        stats = stats_from_headers(reply)
        if stats is None and reply.status == 200:
            stats = stats_from_usage(payload)
        _report(observed, reply, stats)
        state.session.completed(attempt, stats, answered)
        state.metrics.requests.labels(attempt.decision.policy, str(reply.status)).inc()

    observed.after_sent(settle)
    return web.Response(body=payload, status=reply.status,
                        headers=_client_headers(observed, attempt, reply, explained))


async def _first_chunk(
    reply: UpstreamReply, worker_id: str, guard: UpstreamGuard
) -> tuple[bytes | None, AsyncIterator[bytes]]:
    """The stream's first chunk (None: it ended at once) and the rest of it, awaited under
    the first-byte timeout and given up if the worker is found down meanwhile; giving up
    releases the reply and raises :class:`NoFirstByte`, so the request can go elsewhere."""
    chunks = reply.chunks()

    async def first() -> bytes | None:
        try:
            return await anext(chunks)
        except StopAsyncIteration:
            return None

    try:
        chunk = await guard.open(worker_id, first())
    except (*_BROKE_OFF, TimeoutError) as exc:
        reply.release()
        raise NoFirstByte(f"broke off before its first chunk: {exc}") from exc
    except NoFirstByte:
        reply.release()
        raise
    guard.liveness.heard(worker_id, time.monotonic())
    return chunk, chunks


async def _relay_stream(
    state: GatewayState, http_request: web.Request, observed: RequestRecord,
    reply: UpstreamReply, attempt: Attempt, explained: dict[str, str],
    opened: tuple[bytes | None, AsyncIterator[bytes]] | None = None,
    pin: Callable[[str], Awaitable[None]] | None = None,
) -> web.StreamResponse:
    """Relay a stream; with ``pin``, its first chunks are held back until the response id in
    them is pinned (its first event), so a client that sees the id can refer to it."""
    headers = _client_headers(observed, attempt, reply, explained)
    stats = stats_from_headers(reply)
    # The lean HTTP path serves requests that did not ask for a stream, so it writes whole
    # answers only: a worker that streams one anyway has it gathered and sent whole.
    whole: list[bytes] | None = [] if lean_connection_of(http_request) is not None else None
    response = (web.Response(status=reply.status, headers=headers) if whole is not None
                else web.StreamResponse(status=reply.status, headers=headers))

    async def write(data: bytes) -> None:
        if whole is not None:
            whole.append(data)
        else:
            await response.write(data)
    tail = b""  # the end of the stream, where a final usage chunk sits
    broke_off = ""
    wid = attempt.worker_id
    guard = state.guard
    idle = IdleTimer(guard.stream_idle_timeout_s) if guard.stream_idle_timeout_s else None
    try:
        # Inside the try: if the client is already gone, the upstream reply is still released.
        if whole is None:
            await response.prepare(http_request)
        held = b""  # what is held back while the response id is looked for
        async for chunk in _upstream_chunks(reply, wid, guard, idle, opened):
            observed.first_byte()
            state.session.first_token(attempt)  # its prefill no longer queues on the worker
            if stats is None:
                tail = (tail + chunk)[-_USAGE_TAIL_BYTES:]
            if pin is not None:
                held += chunk
                found = response_id_in(held)
                if found is None and len(held) < _ID_SEARCH_BYTES:
                    continue
                if found is not None:
                    await pin(found)
                pin, chunk, held = None, held, b""
            await write(chunk)
        if held:  # it ended before any id
            await write(held)
    except _UpstreamBrokeOff as exc:
        broke_off = f"broke off: {exc}"
        guard.breakers.failure(wid, time.monotonic())
        error = openai_error(f"the worker {wid} {exc}", "upstream_error", code=exc.code)
        await write(f"data: {json.dumps(error)}\n\n".encode())
    finally:
        if idle is not None:
            idle.close()
        # A reply not read to its end closes its connection: the worker sees its client leave.
        reply.release()
    # A usage event the backend held back from the client (it asked for it on our behalf).
    tail += getattr(reply, "withheld", b"")
    ended, done_at = time.monotonic(), time.perf_counter()

    def settle() -> None:  # once the stream's end is out (RequestRecord.after_sent)
        observed.upstream_done(reply.status, broke_off, at=done_at)
        usage = stats or stats_from_usage(tail)
        _report(observed, reply, usage)
        state.session.completed(attempt, usage, ended)

    observed.after_sent(settle)
    if whole is not None and isinstance(response, web.Response):
        response.body = b"".join(whole)  # sent by the middleware, as any whole answer
        return response
    observed.sending()
    try:
        await response.write_eof()
    finally:
        observed.sent()
    return response


class _UpstreamBrokeOff(Exception):
    """The worker's side of a relayed stream failed (the client's side raises as it is)."""

    def __init__(self, message: str, code: str = "stream_interrupted") -> None:
        super().__init__(message)
        self.code = code


async def _upstream_chunks(
    reply: UpstreamReply, worker_id: str, guard: UpstreamGuard, idle: IdleTimer | None,
    opened: tuple[bytes | None, AsyncIterator[bytes]] | None = None,
) -> AsyncIterator[bytes]:
    """The worker's chunks (after ``opened``'s first one, when it was awaited already); each
    one after the first must come within the stream idle timeout (``idle``: only the wait for
    the worker is timed, never the write to a slow client)."""
    timed = False  # the first chunk may wait behind the worker's queue
    if opened is None:
        chunks = reply.chunks()
    else:
        first, chunks = opened
        if first is None:
            return
        timed = True
        yield first
    heard = guard.liveness.heard
    while True:
        if timed and idle is not None:
            idle.wait()
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except asyncio.CancelledError:
            if idle is None or not idle.timed_out():
                raise
            log.warning("stream from %s idle for %gs: ended", worker_id, idle.idle_s)
            raise _UpstreamBrokeOff(
                f"sent nothing for {idle.idle_s:g}s mid-stream (stream idle timeout)",
                "stream_idle_timeout",
            ) from None
        except (*_BROKE_OFF, TimeoutError) as exc:
            log.warning("stream from %s broke off: %s", worker_id, exc)
            raise _UpstreamBrokeOff(f"broke off the stream: {exc}") from exc
        if idle is not None:
            idle.heard()
        heard(worker_id, time.monotonic())
        timed = True
        yield chunk
