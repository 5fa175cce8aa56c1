"""The worker's OpenAI-compatible HTTP API (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` as
server-sent events), ``POST /v1/responses`` (run as a chat; answers kept for
``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``, its ``input_items`` and
``cancel``: :mod:`worker.stored_responses`), ``POST /v1/embeddings`` (hashed bags of tokens,
:mod:`worker.embeddings`),
``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus, vLLM names), ``GET /stats`` (the same numbers as JSON, plus
``engine_info``), ``POST /admin/model``
(swap the served revision, see :mod:`worker.lifecycle`), ``POST /admin/flush``
(drop cached prefixes: all, or one namespace with ``{"namespace": "..."}``; for model or
tokenizer upgrades), ``POST /admin/restart`` (what a restart in place shows from outside,
without one: caches empty, counters at zero, a new ``x-worker-boot-id``), ``GET
/admin/hot-prompts`` (the prompts it sees most, for a gateway warming a new peer; see
:mod:`worker.hotprompts`).

SGLang's probes, so that sglang-router / smg accept the worker as a backend: ``GET
/health_generate``, ``GET /server_info`` and ``/get_server_info`` (model path, context length,
cache size in tokens), ``GET /model_info`` and ``/get_model_info`` (model path, generation
model).

Cache report: every completion response carries, summed over its prompts,

* ``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
  ``prompt_tokens_details.cached_tokens`` and the extension fields ``input_tokens``,
  ``matched_tokens``, ``matched_blocks``, ``cache_hit_ratio``;
* headers ``x-cache-input-tokens``, ``x-cache-matched-tokens``, ``x-cache-matched-blocks``,
  ``x-cache-hit-ratio`` (plus ``x-worker-id`` and ``x-request-id``). A streaming response sends
  its headers once every prompt is admitted (blocks allocated), before the first token; a
  whole one also says when the engine freed the request's blocks (``x-engine-done-at``, the
  host's monotonic clock), which the live replay's simulator follows.

Cache namespace: the ``cache_salt`` body field and/or the ``x-cache-namespace`` header; requests
in different namespaces share no blocks.

Cache priority: the ``cache_priority`` body field (``system`` / ``document`` / ``conversation``,
default ``conversation``) tags the prompt's cached blocks; in a chat request the blocks of the
leading system messages are tagged ``system``. Under memory pressure conversation blocks are
evicted first and system blocks last (see :mod:`worker.kvcache`).

Data-parallel ranks (``--data-parallel-size N``, :mod:`worker.ranks`): N engines, each with its
own cache, behind this one endpoint, as vLLM serves them. A generation request runs on the rank
its ``X-data-parallel-rank`` header names (400 for a value that names none), or its body's
``data_parallel_rank`` (SGLang's field), else on the least loaded rank, and the response says
which in ``x-data-parallel-rank``. ``/metrics`` labels each rank's series ``engine="<rank>"``,
``/stats`` reports the totals plus each rank (``ranks``), ``/admin/flush`` empties every rank,
and rank r publishes its KV events at the configured ports plus r. With N = 1 none of this
shows: no header is needed or sent, and no ``engine`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from gateway.contracts.chat import ChatFormatError
from gateway.contracts.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from gateway.contracts.engine_owners import REFERENCE_OWNER
from gateway.contracts.headers import NAMESPACE_HEADER, WORKER_BOOT_HEADER
from gateway.contracts.httpserver import name_server
from gateway.contracts.kv_keys import engine_namespace
from gateway.contracts.registry_signing import signed
from gateway.contracts.responses import as_chat_body, previous_response, stores
from gateway.contracts.tracing import Tracing
from gateway.contracts.worker_record import WorkerRecord
from worker.auth import auth_middleware
from worker.embeddings import DEFAULT_DIMENSIONS, MAX_DIMENSIONS, as_base64, embed
from worker.engines.base import Engine, EngineStats, EngineUnavailableError
from worker.engines.sim import WORDS, SimCosts, SimEngine
from worker.errors import ApiError, error_middleware
from worker.hotprompts import HOT_PROMPTS_KEY, HotPrompts, export_handler
from worker.kv_events import KVEventPublisher
from worker.kvcache import PrefixCache
from worker.lifecycle import IDENTITY_KEY, identity_for, set_model, ttl_context
from worker.metrics import CONTENT_TYPE, WorkerMetrics
from worker.observe import RequestTrace
from worker.parsing import (
    MAX_TOKEN_ID,
    ChatParams,
    CommonParams,
    Prompt,
    check_model,
    decode_body,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from worker.ranks import (
    RANK_HEADER,
    RankPicker,
    load_score,
    parse_rank,
    rank_endpoint,
    total_by_key,
    total_stats,
)
from worker.register import registration
from worker.respond import Job, respond_stream, respond_whole, response_echo
from worker.settings import SIM_DEFAULT_CACHE_BLOCKS, WorkerSettings
from worker.stored_responses import ResponseStore, StoredResponse, answer_text, input_items
from worker.tokenize_lane import EncodeError, TokenizeLane
from worker.tokenizer import HFTokenizer, Tokenizer, TokenizerUnavailableError, load_tokenizer

SETTINGS_KEY = web.AppKey("worker_settings", WorkerSettings)
# Rank 0's engine: what a single engine's properties (capacity, slots needed) are read from.
ENGINE_KEY = web.AppKey("worker_engine", Engine)
# Every data-parallel rank's engine, by rank (ENGINE_KEY's first).
ENGINES_KEY = web.AppKey[tuple[Engine, ...]]("worker_engines")
RANK_PICKER_KEY = web.AppKey("worker_rank_picker", RankPicker)
TOKENIZER_KEY = web.AppKey("worker_tokenizer", Tokenizer)
LANE_KEY = web.AppKey("worker_tokenize_lane", TokenizeLane)
CHAT_TEMPLATE_KEY = web.AppKey("worker_chat_template", ChatTemplate)
METRICS_KEY = web.AppKey("worker_metrics", WorkerMetrics)
STARTED_KEY = web.AppKey("worker_started", int)


@dataclass(slots=True)
class StartStamp:
    """The worker's start stamp, sent on every reply (``x-worker-boot-id``): new at every
    start and at a restart in place (``POST /admin/restart``)."""

    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


START_STAMP_KEY = web.AppKey("worker_start_stamp", StartStamp)
TRACING_KEY = web.AppKey("worker_tracing", Tracing)
RESPONSE_STORE_KEY = web.AppKey("worker_response_store", ResponseStore)

CLIENT_MAX_SIZE = 32 * 1024 * 1024


# -- helpers -------------------------------------------------------------------------------


async def _read_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(
            f"request body larger than {CLIENT_MAX_SIZE} bytes",
            status=413, code="request_too_large",
        ) from exc
    return decode_body(raw)


async def _encode(
    lane: TokenizeLane, prompts: Sequence[Prompt], params: Sequence[str], special: bool = False,
    system_prefix: str = "",
) -> tuple[list[list[int]], int]:
    """The token ids of each prompt (token lists pass through), in one job of the lane, and
    how many leading tokens of the first the rendered system messages ``system_prefix``
    account for."""
    texts = [p for p in prompts if isinstance(p, str)]
    flags = [special] * len(texts)
    if system_prefix:
        texts.append(system_prefix)
        flags.append(False)
    try:
        encoded = iter(await lane.encode(texts, flags) if texts else [])
    except EncodeError as exc:
        param = params[exc.index] if exc.index < len(params) else params[0]
        raise ApiError(str(exc), param=param, code="invalid_value") from exc
    out = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
    return out, _shared_tokens(next(encoded), out[0]) if system_prefix else 0


def _shared_tokens(prefix: list[int], tokens: list[int]) -> int:
    """How many leading tokens of ``tokens`` equal ``prefix``'s."""
    count = 0
    for a, b in zip(prefix, tokens, strict=False):
        if a != b:
            break
        count += 1
    return count


def _namespace(request: web.Request, common: CommonParams) -> str:
    return engine_namespace(request.headers.get(NAMESPACE_HEADER, ""), common.cache_salt)


def _check_length(
    settings: WorkerSettings, engine: Engine, tokens: list[int], max_tokens: int, param: str
) -> None:
    if len(tokens) + max_tokens > settings.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {settings.max_model_len} tokens; the "
            f"request has {len(tokens)} prompt tokens and asks for {max_tokens} more",
            param=param, code="context_length_exceeded",
        )
    if engine.slots_needed(len(tokens), max_tokens) > engine.capacity_tokens:
        raise ApiError(
            f"the request needs {engine.slots_needed(len(tokens), max_tokens)} KV slots "
            f"({len(tokens)} prompt tokens); the KV cache holds at most "
            f"{engine.capacity_tokens}",
            param=param, code="context_length_exceeded",
        )


def _rank_for(request: web.Request, job: Job) -> int:
    """The data-parallel rank that runs ``request``: the one its ``X-data-parallel-rank``
    header names (vLLM's), else the one its body's ``data_parallel_rank`` names (SGLang's),
    else the least loaded."""
    engines = request.app[ENGINES_KEY]
    pinned = request.headers.get(RANK_HEADER)
    if pinned is not None:
        try:
            return parse_rank(pinned, len(engines))
        except ValueError as exc:
            raise ApiError(str(exc), code="invalid_value") from exc
    in_body = job.common.data_parallel_rank
    if in_body is not None:
        if in_body >= len(engines):
            raise ApiError(f"'data_parallel_rank' must be an integer from 0 to "
                           f"{len(engines) - 1}, got {in_body}", param="data_parallel_rank",
                           code="invalid_value")
        return in_body
    if len(engines) == 1:
        return 0
    return request.app[RANK_PICKER_KEY].pick([load_score(e.stats()) for e in engines])


def _refuse_unscheduled(request: web.Request, job: Job) -> None:
    """Refuse a ``priority`` this worker does not schedule by, as vLLM does (a 400)."""
    if job.common.priority and request.app[SETTINGS_KEY].scheduling_policy != "priority":
        raise ApiError(
            f"'priority' {job.common.priority} needs priority scheduling, which this worker "
            "does not run (--scheduling-policy priority)", param="priority",
            code="invalid_value")


async def _run(request: web.Request, job: Job,
               sample: tuple[str, dict[str, Any], int] | None = None) -> web.StreamResponse:
    """Run ``job``; ``sample``: its path, body and prompt length, to keep among the hottest
    prompts once it is known not to be refused."""
    settings = request.app[SETTINGS_KEY]
    _refuse_unscheduled(request, job)
    if sample is not None:
        _sample(request, *sample, job)
    rank = _rank_for(request, job)
    headers = {
        "x-worker-id": settings.effective_worker_id,
        "x-request-id": job.response_id,
        # New at every start: a gateway that sees it change knows this cache is cold.
        WORKER_BOOT_HEADER: request.app[START_STAMP_KEY].boot_id,
    }
    attributes: dict[str, str | int] = {
        "gen_ai.request.model": job.model, "worker.prompts": len(job.token_lists),
        "worker.id": settings.effective_worker_id,
    }
    if settings.data_parallel_size > 1:
        headers["x-data-parallel-rank"] = str(rank)
        attributes["worker.data_parallel_rank"] = rank
    engine, metrics = request.app[ENGINES_KEY][rank], request.app[METRICS_KEY].rank(rank)
    loop = asyncio.get_running_loop()
    trace = RequestTrace.start(
        request.app[TRACING_KEY], request.headers, f"{request.method} {request.path}",
        loop.time(), attributes,
    )
    status, error = 500, ""
    try:
        respond = respond_stream if job.common.stream else respond_whole
        response = await respond(request, job, headers, engine, metrics, trace)
        status = response.status
        return response
    except asyncio.CancelledError:
        status, error = 499, "the client went away"
        raise
    except Exception as exc:
        status, error = getattr(exc, "status", 500), type(exc).__name__
        raise
    finally:
        trace.finish(loop.time(), status, error)


# -- handlers ------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS_KEY]
    body = await _read_body(request)
    params = parse_completion(body, settings.model)
    names = ["prompt"] if len(params.prompts) == 1 else [
        f"prompt[{i}]" for i in range(len(params.prompts))]
    token_lists, _ = await _encode(app[LANE_KEY], params.prompts, names, params.special_tokens)
    for tokens, param in zip(token_lists, names, strict=True):
        _check_length(settings, app[ENGINE_KEY], tokens, params.common.max_tokens, param)
    job = Job(
        kind="completion",
        response_id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=settings.model,
        common=params.common,
        token_lists=tuple(token_lists),
        namespace=_namespace(request, params.common),
    )
    prompt = params.prompts[0] if len(params.prompts) == 1 else None
    return await _run(request, job, ("/v1/completions", body, len(prompt))
                      if isinstance(prompt, str) else None)


def _sample(request: web.Request, path: str, body: dict[str, Any], chars: int, job: Job) -> None:
    """Keep the request among the hottest prompts (memory only; see worker.hotprompts)."""
    request.app[HOT_PROMPTS_KEY].observe(
        path, body, request.headers.get(NAMESPACE_HEADER, ""), job.namespace,
        job.token_lists[0], chars, time.monotonic())


async def _chat_job(request: web.Request, chat: dict[str, Any], kind: str, id_prefix: str,
                    param: str) -> tuple[Job, ChatParams]:
    """The job of a chat (``chat``, a chat completions body); ``param`` names the prompt in
    errors."""
    app = request.app
    settings = app[SETTINGS_KEY]
    params = parse_chat(chat, settings.model, app[CHAT_TEMPLATE_KEY])
    (tokens,), system_tokens = await _encode(
        app[LANE_KEY], [params.prompt], [param], params.special_tokens, params.system_prefix)
    _check_length(settings, app[ENGINE_KEY], tokens, params.common.max_tokens, param)
    job = Job(
        kind=kind,
        response_id=f"{id_prefix}{uuid.uuid4().hex}",
        created=int(time.time()),
        model=settings.model,
        common=params.common,
        token_lists=(tokens,),
        namespace=_namespace(request, params.common),
        system_tokens=system_tokens,
    )
    return job, params


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_body(request)
    job, params = await _chat_job(request, body, "chat", "chatcmpl-", "messages")
    return await _run(request, job, ("/v1/chat/completions", body, len(params.prompt)))


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API, run as the chat it amounts to (:mod:`gateway.contracts.
    responses`): one assistant message, streamed as Responses events with ``"stream": true``.
    Unless ``"store": false``, the answer is kept (:mod:`worker.stored_responses`); a next turn
    by ``previous_response_id`` runs after the conversation it continues."""
    body = await _read_body(request)
    kept = request.app[RESPONSE_STORE_KEY]
    try:
        chat = as_chat_body(body)
        previous = previous_response(body)
    except ChatFormatError as exc:
        raise ApiError(str(exc), param=exc.param, code="invalid_value") from exc
    before: tuple[Mapping[str, Any], ...] = ()
    if previous is not None:
        found = kept.get(previous)
        if found is None:
            raise ApiError(f"Previous response with id '{previous[:100]}' not found.",
                           status=404, param="previous_response_id",
                           code="previous_response_not_found")
        before = found.conversation
    messages = chat["messages"]
    instructions = messages[:1] if body.get("instructions") is not None else []
    added = tuple(messages[len(instructions):])
    chat["messages"] = [*instructions, *before, *added]
    job, _ = await _chat_job(request, chat, "response", "resp_", "input")
    job = replace(job, echo=response_echo(body))
    if stores(body) and kept.max_entries > 0:
        def keep(response: dict[str, Any]) -> None:
            answer = {"role": "assistant", "content": answer_text(response)}
            kept.put(StoredResponse(
                response, (*before, *added, answer), input_items(body, job.response_id)))

        job = replace(job, on_response=keep)
    return await _run(request, job)


def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    found = request.app[RESPONSE_STORE_KEY].get(response_id)
    if found is None:
        raise ApiError(f"Response with id '{response_id[:100]}' not found.", status=404,
                       code="response_not_found")
    return found


async def stored_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: a stored response as it was answered."""
    return web.json_response(dict(_stored(request).response))


async def stored_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}/input_items``: the input items of a stored response (one
    page holds them all)."""
    data = list(_stored(request).input_items)
    if request.query.get("order") != "asc":  # the Responses API lists newest first
        data.reverse()
    return web.json_response({
        "object": "list", "data": data, "has_more": False,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    })


async def delete_response(request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{id}``."""
    found = _stored(request)
    request.app[RESPONSE_STORE_KEY].delete(str(found.response["id"]))
    return web.json_response({"id": found.response["id"], "object": "response.deleted",
                              "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{id}/cancel``: only a response run in the background can be
    cancelled, and this worker runs none there (every stored response is complete)."""
    _stored(request)
    raise ApiError("Cannot cancel a response that was not created in background mode.",
                   code="invalid_request")


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI embeddings: hashed bags of tokens (:mod:`worker.embeddings`), one per input,
    after the simulated prefill time of their tokens (no KV cache: pooling runs once)."""
    app = request.app
    settings = app[SETTINGS_KEY]
    body = await _read_body(request)
    params = parse_embedding(body, settings.model, DEFAULT_DIMENSIONS, MAX_DIMENSIONS)
    names = ["input"] if len(params.inputs) == 1 else [
        f"input[{i}]" for i in range(len(params.inputs))]
    token_lists, _ = await _encode(app[LANE_KEY], params.inputs, names, True)
    for tokens, param in zip(token_lists, names, strict=True):
        if len(tokens) > settings.max_model_len:
            raise ApiError(
                f"This model's maximum context length is {settings.max_model_len} tokens; "
                f"'{param}' has {len(tokens)}", param=param, code="context_length_exceeded")
    count = sum(map(len, token_lists))
    if settings.prefill_us_per_token > 0:
        await asyncio.sleep(count * settings.prefill_us_per_token / 1e6)
    data = []
    for i, tokens in enumerate(token_lists):
        vec = embed(tokens, params.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": as_base64(vec) if params.base64 else vec})
    return web.json_response(
        {"object": "list", "data": data, "model": settings.model,
         "usage": {"prompt_tokens": count, "total_tokens": count}},
        headers={"x-worker-id": settings.effective_worker_id})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: a ``prompt``'s token ids, or a chat's (``messages``) as the chat
    template renders it."""
    app = request.app
    settings = app[SETTINGS_KEY]
    body = await _read_body(request)
    check_model(body, settings.model)
    if "messages" in body:
        params = parse_chat({**body, "model": settings.model}, settings.model,
                            app[CHAT_TEMPLATE_KEY])
        (tokens,), _ = await _encode(app[LANE_KEY], [params.prompt], ["messages"],
                                     body.get("add_special_tokens") is True)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError("'prompt' must be a string (or send 'messages')", param="prompt",
                           code="invalid_type")
        (tokens,), _ = await _encode(app[LANE_KEY], [prompt], ["prompt"],
                                     body.get("add_special_tokens") is not False)
    return web.json_response(
        {"count": len(tokens), "max_model_len": settings.max_model_len, "tokens": tokens,
         "token_strs": None},
        headers={"x-worker-id": settings.effective_worker_id})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: the text of ``tokens``."""
    app = request.app
    settings = app[SETTINGS_KEY]
    body = await _read_body(request)
    check_model(body, settings.model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
            for t in tokens):
        raise ApiError(f"'tokens' must be a list of token ids in [0, {MAX_TOKEN_ID}]",
                       param="tokens", code="invalid_type")
    tokenizer = app[TOKENIZER_KEY]
    if isinstance(tokenizer, HFTokenizer):
        text = tokenizer.decode(tokens)
    else:
        piece = detokenizer(tokenizer)
        text = "".join(piece(t) for t in tokens)
    return web.json_response({"prompt": text},
                             headers={"x-worker-id": settings.effective_worker_id})


async def models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": settings.model,
                    "object": "model",
                    "created": request.app[STARTED_KEY],
                    "owned_by": REFERENCE_OWNER,
                    "max_model_len": settings.max_model_len,
                    **request.app[IDENTITY_KEY].as_dict(),
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def reported_cache_tokens(settings: WorkerSettings, engine: Engine) -> int:
    """The cache size this worker publishes, in tokens (0: it does not publish one)."""
    if not settings.report_cache_size:
        return 0
    if settings.reported_cache_blocks:
        return settings.reported_cache_blocks * settings.block_size
    return engine.capacity_tokens


async def server_info(request: web.Request) -> web.Response:
    """SGLang's ``/server_info``: what its routers read about a backend (the cache size is one
    data-parallel rank's; ``dp_size`` says how many there are)."""
    settings = request.app[SETTINGS_KEY]
    info: dict[str, Any] = {
        "model_path": settings.model,
        "served_model_name": settings.model,
        "context_length": settings.max_model_len,
        "max_running_requests": settings.max_running,
        "page_size": settings.block_size,
        "version": "reference-worker",
        "dp_size": settings.data_parallel_size,
    }
    tokens = reported_cache_tokens(settings, request.app[ENGINE_KEY])
    if tokens:
        info["max_total_num_tokens"] = tokens
    return web.json_response(info)


async def model_info(request: web.Request) -> web.Response:
    """SGLang's ``/model_info``."""
    settings = request.app[SETTINGS_KEY]
    return web.json_response({
        "model_path": settings.model,
        "served_model_name": settings.model,
        "is_generation": True,
        "max_context_length": settings.max_model_len,
    })


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def stats_payload(app: web.Application) -> dict[str, Any]:
    """``/stats``: the engine's numbers; with data-parallel ranks their totals in the same
    shape, plus each rank's own (``ranks``)."""
    engines = app[ENGINES_KEY]
    snapshots = [engine.stats() for engine in engines]
    by_priority = [_cache_of(engine).cached_blocks_by_priority() for engine in engines]
    if len(engines) == 1:
        payload = _stats_of(app, snapshots[0], by_priority[0], engines[0])
        payload["data_parallel_size"] = 1
        return payload
    payload = _stats_of(app, total_stats(snapshots), total_by_key(by_priority), engines[0])
    payload["data_parallel_size"] = len(engines)
    payload["ranks"] = [
        {"rank": rank, **_stats_of(app, stats, blocks, engine)}
        for rank, (stats, blocks, engine) in enumerate(
            zip(snapshots, by_priority, engines, strict=True))
    ]
    return payload


def _stats_of(app: web.Application, stats: EngineStats, cached_by_priority: dict[str, int],
              engine: Engine) -> dict[str, Any]:
    """One engine's ``/stats`` payload (or the ranks' totals, as one engine's)."""
    settings = app[SETTINGS_KEY]
    cache = asdict(stats.cache)
    cache["hit_rate"] = (
        stats.cache.hit_tokens / stats.cache.queries_tokens if stats.cache.queries_tokens else 0.0
    )
    payload: dict[str, Any] = asdict(stats)
    payload["cache"] = cache
    cache["cached_blocks_by_priority"] = cached_by_priority
    payload.update(
        worker_id=settings.effective_worker_id,
        model=settings.model,
        engine=settings.engine,
        tokenizer=app[TOKENIZER_KEY].name,
        engine_info=engine.info(),
    )
    return payload


def _cache_of(engine: Engine) -> PrefixCache:
    cache = getattr(engine, "cache", None)
    assert isinstance(cache, PrefixCache)
    return cache


async def stats(request: web.Request) -> web.Response:
    return web.json_response(stats_payload(request.app))


async def flush(request: web.Request) -> web.Response:
    """Drop cached prefixes: all of them, or one namespace (``{"namespace": "..."}``, the
    ``x-cache-namespace`` value and/or ``cache_salt`` as this worker combines them), in every
    data-parallel rank."""
    raw = await request.read()
    body = decode_body(raw) if raw.strip() else {}
    namespace = body.get("namespace", request.query.get("namespace"))
    if namespace is not None and not isinstance(namespace, str):
        raise ApiError("'namespace' must be a string", param="namespace", code="invalid_type")
    dropped = sum(engine.flush(namespace) for engine in request.app[ENGINES_KEY])
    return web.json_response({"flushed_blocks": dropped, "namespace": namespace})


async def restart_in_place(request: web.Request) -> web.Response:
    """What a gateway sees of this worker restarted behind the same address (between two of
    its probes, so that none finds it down), without a restart: every rank's cache empty, the
    engines' counters back to zero (vLLM's ``prefix_cache_queries`` falls) and a new start
    stamp on every reply. For tests and the replay harness (``--restart-in-place I@T``)."""
    dropped = sum(engine.restart_in_place() for engine in request.app[ENGINES_KEY])
    stamp = request.app[START_STAMP_KEY]
    stamp.boot_id = StartStamp().boot_id
    return web.json_response({"flushed_blocks": dropped, "boot_id": stamp.boot_id})


# -- app -----------------------------------------------------------------------------------


def detokenizer(tokenizer: Tokenizer) -> Callable[[int], str]:
    """Token id -> output text piece: the HF tokenizer's ``decode``, else a pseudo-word."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.decode_one

    def word(token_id: int) -> str:
        return " " + WORDS[token_id % len(WORDS)]

    return word


def build_engine(settings: WorkerSettings, tokenizer: Tokenizer) -> Engine:
    """The configured engine. Raises ``EngineUnavailableError`` when torch is missing or the
    model files are unusable."""
    if settings.engine == "torch":
        try:
            from worker.engines.torch_engine import TorchEngine, TorchEngineConfig
        except ImportError as exc:
            raise EngineUnavailableError(
                "--engine torch needs PyTorch: pip install '.[torch]' (or torch==2.13.0)"
            ) from exc
        config = TorchEngineConfig(
            model_config=settings.model_config,
            model_weights=settings.model_weights,
            model_seed=settings.model_seed,
            device=settings.device,
            model_dtype=settings.model_dtype,
            kv_dtype=settings.kv_dtype,
            block_size=settings.block_size,
            cache_blocks=settings.cache_blocks,
            cache_memory_fraction=settings.cache_memory_fraction,
            max_running=settings.max_running,
        )
        return TorchEngine.build(config, detokenizer(tokenizer))
    cache = PrefixCache(settings.cache_blocks or SIM_DEFAULT_CACHE_BLOCKS, settings.block_size,
                        reuse=settings.cache_reuse)
    return SimEngine(cache, max_running=settings.max_running, costs=SimCosts.of(settings))


def build_engines(settings: WorkerSettings, tokenizer: Tokenizer) -> tuple[Engine, ...]:
    """One engine per data-parallel rank, every one with the cache of the first: a torch
    engine with ``--cache-blocks 0`` sizes its pool from the memory available when it is
    built, so sized one after the other each rank would get less than the one before (the
    earlier ranks' models and pools are already loaded). As vLLM gives every rank the same
    memory settings, the first rank's size holds for all."""
    first = build_engine(settings, tokenizer)
    if settings.data_parallel_size == 1:
        return (first,)
    same = replace(settings, cache_blocks=first.stats().cache.num_blocks)
    return (first, *(build_engine(same, tokenizer)
                     for _ in range(settings.data_parallel_size - 1)))


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    yield
    app[LANE_KEY].close()
    for engine in app[ENGINES_KEY]:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _kv_events(settings: WorkerSettings, caches: Sequence[PrefixCache]) -> Callable[
    [web.Application], AsyncIterator[None]
]:
    """Publishes each rank's cache's KV events while the app runs, rank r at the configured
    endpoints' ports + r (see :mod:`worker.kv_events`)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for rank, cache in enumerate(caches):
                publisher = KVEventPublisher(
                    rank_endpoint(settings.kv_events, rank),
                    rank_endpoint(settings.kv_replay, rank),
                    block_size=cache.block_size, buffer_steps=settings.kv_events_buffer,
                    data_parallel_rank=rank,
                )
                await stack.enter_async_context(_publishing(publisher, cache))
            yield

    return ctx


@contextlib.asynccontextmanager
async def _publishing(publisher: KVEventPublisher, cache: PrefixCache) -> AsyncIterator[None]:
    """``cache``'s events go to ``publisher`` (started and closed here)."""
    try:
        publisher.start()
        cache.listener = publisher
        yield
    finally:
        cache.listener = None
        await publisher.close()


def create_app(
    settings: WorkerSettings,
    *,
    tokenizer: Tokenizer | None = None,
    span_exporter: SpanExporter | None = None,
) -> web.Application:
    """The worker application. Raises ``TokenizerUnavailableError`` for a bad tokenizer file
    and ``EngineUnavailableError`` when the engine cannot be built. ``span_exporter``: export
    spans there as they end (tests), whatever ``settings.otel_endpoint`` says."""
    app = web.Application(
        middlewares=[
            error_middleware,
            auth_middleware(settings.api_key, settings.admin_token),
        ],
        client_max_size=CLIENT_MAX_SIZE,
    )
    tok = tokenizer if tokenizer is not None else load_tokenizer(
        settings.tokenizer_file, settings.tokenizer
    )
    engines = build_engines(settings, tok)
    engine = engines[0]
    app[SETTINGS_KEY] = settings
    app[ENGINE_KEY] = engine
    app[ENGINES_KEY] = engines
    app[RANK_PICKER_KEY] = RankPicker(len(engines))
    app[TOKENIZER_KEY] = tok
    app[LANE_KEY] = TokenizeLane(tok)
    try:
        app[CHAT_TEMPLATE_KEY] = load_chat_template(settings.chat_template)
    except ChatTemplateError as exc:
        raise TokenizerUnavailableError(str(exc)) from exc
    app[IDENTITY_KEY] = identity_for(settings, tok)
    caches = [_cache_of(e) for e in engines]
    if settings.cache_ttl_s > 0:
        app.cleanup_ctx.append(ttl_context(caches, settings.cache_ttl_s))
    app.cleanup_ctx.append(_engine_lifetime)
    if settings.kv_events:
        app.cleanup_ctx.append(_kv_events(settings, caches))
    app[METRICS_KEY] = WorkerMetrics(
        engines, settings.model, report_cache_size=settings.report_cache_size,
        reported_cache_blocks=settings.reported_cache_blocks,
    )
    name_server(app, "affinity-worker")
    app[STARTED_KEY] = int(time.time())
    app[START_STAMP_KEY] = StartStamp()
    tracing = Tracing.build(settings.tracing_options(), span_exporter)
    app[TRACING_KEY] = tracing

    async def _tracing_lifetime(app: web.Application) -> AsyncIterator[None]:
        yield
        await tracing.shutdown()

    app.cleanup_ctx.append(_tracing_lifetime)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app[RESPONSE_STORE_KEY] = ResponseStore(settings.stored_responses)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", stored_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_post("/admin/flush", flush)
    app.router.add_post("/admin/restart", restart_in_place)
    app.router.add_post("/admin/model", set_model)
    app[HOT_PROMPTS_KEY] = HotPrompts(settings.hot_prompts, min_tokens=settings.block_size)
    app.router.add_get("/admin/hot-prompts", export_handler(settings))
    if settings.store:
        record = signed(WorkerRecord(
            id=settings.effective_worker_id,
            url=settings.effective_public_url,
            models=(settings.model,),
            capacity_blocks=reported_cache_tokens(settings, engine) // settings.block_size,
            block_size=settings.block_size,
            kv_events=settings.advertised(settings.kv_events) if settings.kv_events else "",
            kv_replay=settings.advertised(settings.kv_replay) if settings.kv_replay else "",
            dp_size=settings.data_parallel_size,
        ), settings.registration_secret())
        app.cleanup_ctx.append(registration(
            settings.store, record, every_s=settings.heartbeat_s, ttl_s=settings.registry_ttl_s,
            prefix=settings.store_prefix,
        ))
    return app
