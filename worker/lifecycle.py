"""Model identity and cache lifetime of the reference worker.

* **Identity.** ``/v1/models`` reports, besides the model name, its ``revision`` (the weights'
  version: ``--model-revision``, else derived from the engine) and ``tokenizer_hash``. A gateway
  keys its prefix index by them and, when they change, drops what it knew about this worker and
  flushes its cache. ``POST /admin/model {"revision": "..."}`` swaps the served revision in
  place (what a weight reload does), so that rollout can be exercised without a restart.
* **TTL.** With ``--cache-ttl-s``, cached blocks no request has used for that long are dropped
  (checked a few times per TTL, in every data-parallel rank's cache), so stale prefixes do not
  linger in a quiet worker.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.contracts.tasks import running
from worker.errors import ApiError
from worker.kvcache import PrefixCache
from worker.parsing import decode_body
from worker.settings import WorkerSettings
from worker.tokenizer import Tokenizer


@dataclass(slots=True)
class ModelIdentity:
    """What the served model is; mutable only through ``POST /admin/model``."""

    revision: str
    tokenizer_hash: str

    def as_dict(self) -> dict[str, str]:
        return {"revision": self.revision, "tokenizer_hash": self.tokenizer_hash}


IDENTITY_KEY = web.AppKey("worker_model_identity", ModelIdentity)


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def identity_for(settings: WorkerSettings, tokenizer: Tokenizer) -> ModelIdentity:
    revision = settings.model_revision
    if not revision:
        if settings.engine == "torch" and settings.model_weights:
            revision = "weights-" + _file_digest(settings.model_weights)
        elif settings.engine == "torch":
            revision = f"{settings.model_config}-seed{settings.model_seed}"
        else:
            revision = settings.engine
    source = _file_digest(settings.tokenizer_file) if settings.tokenizer_file else tokenizer.name
    tokenizer_hash = hashlib.sha256(source.encode()).hexdigest()[:16]
    return ModelIdentity(revision, tokenizer_hash)


async def set_model(request: web.Request) -> web.Response:
    """``POST /admin/model {"revision": "..."}``: serve another revision from now on."""
    raw = await request.read()
    body = decode_body(raw) if raw.strip() else {}
    revision = body.get("revision")
    if not isinstance(revision, str) or not revision:
        raise ApiError("'revision' must be a non-empty string", param="revision",
                       code="invalid_value")
    identity = request.app[IDENTITY_KEY]
    identity.revision = revision
    return web.json_response(identity.as_dict())


async def _expire_loop(caches: Sequence[PrefixCache], ttl_s: float) -> None:
    every = min(max(ttl_s / 4, 0.05), 5.0)
    while True:
        await asyncio.sleep(every)
        for cache in caches:
            cache.expire(ttl_s)


def ttl_context(
    caches: Sequence[PrefixCache], ttl_s: float
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that expires the caches' idle blocks while the app runs."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        async with running(_expire_loop(caches, ttl_s), "cache-ttl"):
            yield

    return ctx
