"""The worker's hottest prompts, exported to warm a peer (``GET /admin/hot-prompts``).

A gateway warming a worker that joins the fleet can ask the workers already serving for the
prompts they see most: they hold the text anyway, the gateway keeps none of it. This module
keeps, in this process's memory only, one recent request per shared prefix (the namespace and
the first ``prefix_tokens`` prompt tokens: a system prompt and the conversations built on it
count as one), with a use count halved every ``half_life_s``; at most ``capacity`` prefixes
(the least used one is dropped for a new one) and prompts up to ``max_chars`` characters.

The export answers only on a worker that has an admin secret (``--admin-token`` or
``--api-key``, which the admin middleware checks): without one it refuses with 403 rather than
hand prompt text to anyone who can reach the port. ``--hot-prompts 0`` keeps nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from aiohttp import web

from worker.errors import ApiError
from worker.settings import WorkerSettings

# The fields of a request body that say what the prompt is (the rest is generation settings,
# which a prefill-only replay sets itself).
_PROMPT_FIELDS = ("model", "messages", "prompt", "cache_salt")
_MAX_LIMIT = 1024


@dataclass(slots=True)
class _Entry:
    path: str
    body: dict[str, Any]
    namespace: str  # the x-cache-namespace header it came with
    uses: float
    at: float


class HotPrompts:
    def __init__(self, capacity: int = 64, *, max_chars: int = 200_000,
                 prefix_tokens: int = 64, half_life_s: float = 300.0,
                 min_tokens: int = 1) -> None:
        self.capacity = capacity
        self.max_chars = max_chars
        self.prefix_tokens = prefix_tokens
        # Shorter prompts leave no whole block in the cache: nothing a replay would warm (a
        # gateway's one-character probe, for one).
        self.min_tokens = max(1, min_tokens)
        self.half_life_s = half_life_s
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, path: str, body: Mapping[str, Any], namespace: str, engine_namespace: str,
                tokens: Sequence[int], chars: int, now: float) -> None:
        """One admitted request: ``namespace`` is its header value, ``engine_namespace`` what
        the cache keys it by (header and salt), ``chars`` the length of its prompt text."""
        if self.capacity <= 0 or len(tokens) < self.min_tokens or chars > self.max_chars:
            return
        digest = xxhash.xxh3_64()
        digest.update(engine_namespace.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
        digest.update(",".join(map(str, tokens[:self.prefix_tokens])).encode())
        key = digest.intdigest()
        old = self._entries.get(key)
        uses = 1.0 + (self._decayed(old, now) if old is not None else 0.0)
        if old is None and len(self._entries) >= self.capacity:
            coldest = min(self._entries, key=lambda k: self._decayed(self._entries[k], now))
            if self._decayed(self._entries[coldest], now) > uses:
                return  # every kept prefix is used more than a first sighting
            del self._entries[coldest]
        kept = {k: body[k] for k in _PROMPT_FIELDS if k in body}
        self._entries[key] = _Entry(path, kept, namespace, uses, now)

    def _decayed(self, entry: _Entry, now: float) -> float:
        if self.half_life_s <= 0 or now <= entry.at:
            return entry.uses
        return float(entry.uses * math.pow(0.5, (now - entry.at) / self.half_life_s))

    def hottest(self, limit: int, now: float) -> list[dict[str, Any]]:
        """Up to ``limit`` prompts, most used first."""
        ranked = sorted(self._entries.values(), key=lambda e: -self._decayed(e, now))
        return [
            {"path": e.path, "body": e.body, "namespace": e.namespace,
             "uses": round(self._decayed(e, now), 3)}
            for e in ranked[:limit]
        ]


HOT_PROMPTS_KEY = web.AppKey("worker_hot_prompts", HotPrompts)


def export_handler(settings: WorkerSettings) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def hot_prompts(request: web.Request) -> web.Response:
        if not (settings.admin_token or settings.api_key):
            raise ApiError("exporting prompts needs an admin secret on this worker "
                           "(--admin-token or --api-key)", status=403, code="forbidden")
        raw = request.query.get("limit", "64")
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= _MAX_LIMIT:
            raise ApiError(f"'limit' must be an integer from 1 to {_MAX_LIMIT}", param="limit",
                           code="invalid_value")
        data = request.app[HOT_PROMPTS_KEY].hottest(int(raw), time.monotonic())
        return web.json_response({"object": "list", "data": data},
                                 headers={"Cache-Control": "no-store"})

    return hot_prompts
