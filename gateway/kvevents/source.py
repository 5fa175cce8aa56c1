"""The gateway's engine-exact cache source: event feeds, the exact index, the tokenizer.

One :class:`ExactSource` per gateway application. It

* subscribes to the event endpoint of every worker that announces one (and drops the feed when
  the worker leaves; a worker the pool marks down is emptied and bootstraps again);
* turns requests into token-exact keys when a tokenizer is configured;
* wraps the modelled index for routing, so one policy routes over workers with and without
  events: by default (``view="hybrid"``, :class:`~gateway.kvevents.hybrid.HybridMatcher`) an
  event-fed worker's view is the model's, corrected by its events; with ``view="events"``
  (:class:`~gateway.kvevents.index.ExactMatcher`) it comes from its events alone, plus what this
  gateway just sent there until the events confirm it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gateway.backends.base import UpstreamRequest
from gateway.contracts.engine_paths import COMPLETIONS_PATH
from gateway.contracts.kv_keys import engine_namespace
from gateway.contracts.responses import RESPONSES_PATH, as_chat_body
from gateway.kvevents.endpoints import EventEndpoints
from gateway.kvevents.hybrid import HybridMatcher
from gateway.kvevents.index import ExactIndex, ExactMatcher
from gateway.kvevents.subscriber import KVEventHub
from gateway.kvevents.tokenize import PromptTokenizer, TokenizedPrompt
from gateway.routing.types import PrefixMatcher

log = logging.getLogger(__name__)


class WorkerSet(Protocol):
    def event_endpoints(self) -> dict[str, EventEndpoints]: ...

    def healthy_ids(self) -> set[str]: ...

    def capacities(self) -> dict[str, int]:
        """Each worker's cache size in prompt-key blocks (0: unknown)."""
        ...

    def model_holds(self, wid: str, block: int) -> bool:
        """Whether the modelled index says the worker holds the prefix ``block`` names."""
        ...

    def retain_index(self, wid: str, keep: Callable[[int], bool]) -> None:
        """The modelled index keeps of the worker only the blocks ``keep`` accepts."""
        ...


VIEWS = ("hybrid", "events")


class ExactSource:
    def __init__(
        self,
        tokenizer: PromptTokenizer | None = None,
        *,
        max_blocks: int = 1 << 20,
        pending_ttl_s: float = 10.0,
        replay_timeout_s: float = 1.0,
        reconcile_s: float = 0.5,
        min_match_blocks: int = 1,
        view: str = "hybrid",
        settle_s: float = 2.0,
        skew_s: float = 0.005,
    ) -> None:
        if view not in VIEWS:
            raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
        self.view = view
        self.index = ExactIndex(max_blocks=max_blocks, pending_ttl_s=pending_ttl_s,
                                settle_s=settle_s, skew_s=skew_s, hybrid=view == "hybrid")
        self._sync_clock()
        self.hub = KVEventHub(self.index, replay_timeout_s=replay_timeout_s)
        self.tokenizer = tokenizer
        self._reconcile_s = reconcile_s
        self._floor = min_match_blocks
        self._task: asyncio.Task[None] | None = None
        self._healthy: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, workers: WorkerSet) -> None:
        self.index.model_holds = workers.model_holds
        self.index.on_reset = workers.retain_index
        self.hub.start()
        self.reconcile(workers)
        self._task = asyncio.create_task(self._loop(workers), name="kv-events-reconcile")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.hub.close()
        if self.tokenizer is not None:
            self.tokenizer.close()

    async def _loop(self, workers: WorkerSet) -> None:
        while True:
            await asyncio.sleep(self._reconcile_s)
            try:
                self.reconcile(workers)
            except Exception:
                log.exception("kv events: reconciling the feeds failed")

    def _sync_clock(self) -> None:
        # Events are stamped with the engines' wall clock, decisions with time.monotonic().
        self.index.clock.offset = time.time() - time.monotonic()

    def reconcile(self, workers: WorkerSet) -> None:
        """Feeds follow the pool; a worker that went down loses what its feed said."""
        self._sync_clock()
        endpoints = workers.event_endpoints()
        self.hub.sync(endpoints)
        for wid in endpoints:  # what is sent there counts from now on, live feed or not yet
            self.index.worker(wid)
        for wid, blocks in workers.capacities().items():
            self.index.set_capacity(wid, blocks)
        healthy = workers.healthy_ids()
        for wid in self._healthy - healthy:
            self.hub.worker_down(wid)
        self._healthy = healthy

    # -- the request path (no I/O but the tokenizer pool) ---------------------------------------
    async def key(
        self, body: Mapping[str, Any], *, chat: bool, tenant: str, cache_salt: str
    ) -> TokenizedPrompt | None:
        if self.tokenizer is None:
            return None
        return await self.tokenizer.key(
            body, chat=chat, salt=engine_namespace(tenant, cache_salt)
        )

    async def leading_ids(self, upstream: UpstreamRequest, tokens: int) -> list[int] | None:
        """The first ``tokens`` token ids the engine runs for ``upstream`` (the pre-warmer's
        copy of a held prefix; a Responses request as the chat it amounts to); None without a
        tokenizer or where they cannot be had."""
        if self.tokenizer is None:
            return None
        body = upstream.body
        if upstream.path == RESPONSES_PATH:
            body = as_chat_body(body)
        return await self.tokenizer.leading_ids(
            body, chat=upstream.path != COMPLETIONS_PATH, tokens=tokens)

    def matcher(self, base: PrefixMatcher, now: float) -> PrefixMatcher:
        if not self.index.has_live:
            return base
        if self.view == "events":
            return ExactMatcher(base, self.index, now, self._floor)
        return HybridMatcher(base, self.index, now, self._floor)

    def sent(self, worker_id: str, blocks: Sequence[int], now: float) -> None:
        # The admitted request holds a block of its own (the prompt's partial last block, the
        # output) that cached prefixes cannot use meanwhile, as the modelled index counts it.
        # The other requests in flight are not counted: this gateway's count holds requests
        # in transit, queued and answered but not yet read, and over-counts those the engine
        # runs (BENCHMARKS.md, "The events view's RAG drift").
        self.index.sent(worker_id, blocks, now, reserve=1)

    def unsent(self, worker_id: str, blocks: Sequence[int]) -> None:
        self.index.unsent(worker_id, blocks)

    def done(self, worker_id: str, blocks: Sequence[int], now: float) -> None:
        self.index.done(worker_id, blocks, now)

    # -- the operator's view --------------------------------------------------------------------
    def source_of(self, worker_id: str) -> str:
        return "events" if self.index.is_live(worker_id) else "model"

    def describe(self, worker_id: str) -> dict[str, Any] | None:
        feed = self.hub.feed(worker_id)
        if feed is None:
            return None
        blocks = self.index.get(worker_id)
        s = feed.stats
        return {
            "endpoint": feed.endpoints.events,
            "replay_endpoint": feed.endpoints.replay,
            "state": feed.state,
            "last_seq": s.last_seq,
            "batches": s.batches,
            "events": s.events,
            "gaps": s.gaps,
            "replayed_batches": s.replayed,
            "unreplayable_gaps": s.unreplayable,
            "restarts": s.restarts,
            "bad_messages": s.bad_messages,
            "reads": s.reads,
            "blocks": len(blocks) if blocks is not None else 0,
            "pending_blocks": blocks.pending if blocks is not None else 0,
            "orphan_blocks": blocks.stats.orphans if blocks is not None else 0,
            "view": self.view,
            "corrections": self._corrections(worker_id),
        }

    def _corrections(self, worker_id: str) -> dict[str, int] | None:
        fix = self.index.corrections(worker_id)
        if fix is None or self.view != "hybrid":
            return None
        s = fix.stats
        return {
            "removed": s.removed,
            "kept_in_flight": s.kept,
            "foreign_stored": s.foreign,
            "resets": s.resets,
            "gone_blocks": len(fix.gone),
            "foreign_blocks": len(fix.foreign),
        }

    def tokenizer_stats(self) -> dict[str, Any] | None:
        tok = self.tokenizer
        if tok is None:
            return None
        s, p = tok.stats, tok.prefixes.stats
        return {
            "file": tok.opts.path,
            "block_size": tok.opts.block_size,
            "prompts": s.prompts,
            "fallbacks": s.fallbacks,
            "tokens": s.tokens,
            "mean_ms": 1000 * s.seconds / s.prompts if s.prompts else 0.0,
            "prefix_store": {
                "segments": len(tok.prefixes),
                "reused_prompts": p.reused,
                "reused_tokens": p.reused_tokens,
                "mismatches": p.mismatches,
                "pieced_prompts": p.pieced,
                "evicted": p.evicted,
            },
        }
