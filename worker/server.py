"""The worker's OpenAI-compatible HTTP API (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` as
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, vLLM
names), ``GET /stats`` (the same numbers as JSON).

Cache report: every completion response carries, summed over its prompts,

* ``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
  ``prompt_tokens_details.cached_tokens`` and the extension fields ``input_tokens``,
  ``matched_tokens``, ``matched_blocks``, ``cache_hit_ratio``;
* headers ``x-cache-input-tokens``, ``x-cache-matched-tokens``, ``x-cache-matched-blocks``,
  ``x-cache-hit-ratio`` (plus ``x-worker-id`` and ``x-request-id``). A streaming response sends
  its headers once every prompt is admitted (blocks allocated), before the first token.

Cache namespace: the ``cache_salt`` body field and/or the ``x-cache-namespace`` header; requests
in different namespaces share no blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict
from typing import Any

from aiohttp import web

from worker.engines.base import Engine
from worker.engines.sim import SimCosts, SimEngine
from worker.errors import ApiError, error_middleware
from worker.kvcache import PrefixCache
from worker.metrics import CONTENT_TYPE, WorkerMetrics
from worker.parsing import (
    CommonParams,
    Prompt,
    decode_body,
    parse_chat,
    parse_completion,
)
from worker.respond import Job, respond_stream, respond_whole
from worker.settings import WorkerSettings
from worker.tokenizer import Tokenizer, load_tokenizer

SETTINGS_KEY = web.AppKey("worker_settings", WorkerSettings)
ENGINE_KEY = web.AppKey("worker_engine", Engine)
TOKENIZER_KEY = web.AppKey("worker_tokenizer", Tokenizer)
METRICS_KEY = web.AppKey("worker_metrics", WorkerMetrics)
STARTED_KEY = web.AppKey("worker_started", int)

NAMESPACE_HEADER = "x-cache-namespace"
CLIENT_MAX_SIZE = 32 * 1024 * 1024
# Texts longer than this are tokenized in a thread so the event loop keeps serving.
THREAD_TOKENIZE_CHARS = 8192


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


async def _encode(tokenizer: Tokenizer, prompt: Prompt, param: str) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    try:
        if len(prompt) > THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(tokenizer.encode, prompt)
        return tokenizer.encode(prompt)
    except ValueError as exc:
        raise ApiError(str(exc), param=param, code="invalid_value") from exc


def _namespace(request: web.Request, common: CommonParams) -> str:
    header = request.headers.get(NAMESPACE_HEADER, "")
    if header and common.cache_salt:
        return f"{header}\x1f{common.cache_salt}"
    return header or common.cache_salt


def _check_length(
    settings: WorkerSettings, engine: Engine, tokens: list[int], max_tokens: int, param: str
) -> None:
    if len(tokens) + max_tokens > settings.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {settings.max_model_len} tokens; the "
            f"request has {len(tokens)} prompt tokens and asks for {max_tokens} more",
            param=param, code="context_length_exceeded",
        )
    if len(tokens) > engine.capacity_tokens:
        raise ApiError(
            f"the prompt has {len(tokens)} tokens; the KV cache holds at most "
            f"{engine.capacity_tokens}",
            param=param, code="context_length_exceeded",
        )


async def _run(request: web.Request, job: Job) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    headers = {"x-worker-id": settings.effective_worker_id, "x-request-id": job.response_id}
    engine, metrics = request.app[ENGINE_KEY], request.app[METRICS_KEY]
    if job.common.stream:
        return await respond_stream(request, job, headers, engine, metrics)
    return await respond_whole(request, job, headers, engine, metrics)


# -- handlers ------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS_KEY]
    params = parse_completion(await _read_body(request), settings.model)
    token_lists: list[list[int]] = []
    for i, prompt in enumerate(params.prompts):
        param = "prompt" if len(params.prompts) == 1 else f"prompt[{i}]"
        tokens = await _encode(app[TOKENIZER_KEY], prompt, param)
        _check_length(settings, app[ENGINE_KEY], tokens, params.common.max_tokens, param)
        token_lists.append(tokens)
    job = Job(
        kind="completion",
        response_id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=settings.model,
        common=params.common,
        token_lists=tuple(token_lists),
        namespace=_namespace(request, params.common),
    )
    return await _run(request, job)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS_KEY]
    params = parse_chat(await _read_body(request), settings.model)
    tokens = await _encode(app[TOKENIZER_KEY], params.prompt, "messages")
    _check_length(settings, app[ENGINE_KEY], tokens, params.common.max_tokens, "messages")
    job = Job(
        kind="chat",
        response_id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=settings.model,
        common=params.common,
        token_lists=(tokens,),
        namespace=_namespace(request, params.common),
    )
    return await _run(request, job)


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
                    "owned_by": "worker",
                    "max_model_len": settings.max_model_len,
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def stats_payload(app: web.Application) -> dict[str, Any]:
    settings = app[SETTINGS_KEY]
    stats = app[ENGINE_KEY].stats()
    cache = asdict(stats.cache)
    cache["hit_rate"] = (
        stats.cache.hit_tokens / stats.cache.queries_tokens if stats.cache.queries_tokens else 0.0
    )
    payload: dict[str, Any] = asdict(stats)
    payload["cache"] = cache
    payload.update(
        worker_id=settings.effective_worker_id,
        model=settings.model,
        engine=settings.engine,
        tokenizer=app[TOKENIZER_KEY].name,
    )
    return payload


async def stats(request: web.Request) -> web.Response:
    return web.json_response(stats_payload(request.app))


# -- app -----------------------------------------------------------------------------------


def build_engine(settings: WorkerSettings) -> SimEngine:
    cache = PrefixCache(settings.cache_blocks, settings.block_size)
    costs = SimCosts(
        prefill_us_per_token=settings.prefill_us_per_token,
        prefill_us_per_cached_token=settings.prefill_us_per_cached_token,
        decode_ms_per_token=settings.decode_ms_per_token,
    )
    return SimEngine(cache, max_running=settings.max_running, costs=costs)


def create_app(settings: WorkerSettings, *, tokenizer: Tokenizer | None = None) -> web.Application:
    """The worker application. Raises ``TokenizerUnavailableError`` for a bad tokenizer file."""
    app = web.Application(middlewares=[error_middleware], client_max_size=CLIENT_MAX_SIZE)
    engine = build_engine(settings)
    app[SETTINGS_KEY] = settings
    app[ENGINE_KEY] = engine
    app[TOKENIZER_KEY] = tokenizer if tokenizer is not None else load_tokenizer(
        settings.tokenizer_file
    )
    app[METRICS_KEY] = WorkerMetrics(engine, settings.model)
    app[STARTED_KEY] = int(time.time())
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    return app
