"""A SIMULATED inference engine: real prefix-cache bookkeeping, no model.

:class:`SimEngine` admits requests exactly like a real engine would account for them: at most
``max_running`` run at once, the rest wait in a FIFO queue (head-of-line: a request that cannot get
KV blocks keeps the ones behind it waiting too), and each admitted request allocates its prompt's
blocks in a :class:`~worker.kvcache.PrefixCache` (tagged with the request's priority class),
reusing the longest cached prefix. What it does
NOT do is run a model. Time follows a cost model (:class:`SimCosts`):

* prefill: ``uncached_tokens * prefill_us_per_token + cached_tokens * prefill_us_per_cached_token``;
  the first output token is emitted right after prefill (under ``Reuse.SCHEDULED``, and once
  the requests still computing blocks it reused are done with them, as an engine's step);
* decode: ``decode_ms_per_token`` before each further output token.

Running requests do not slow each other down, unless ``prefill_shared``: then the requests in
prefill share the engine's compute, each progressing at ``1/n`` of its speed while ``n`` are in
prefill (:mod:`worker.engines.compute`), so a worker given more work answers it later. The
output is ``max_tokens`` deterministic pseudo-words chosen by a PRNG seeded with the prompt's
hash; the finish reason is always ``"length"``. Only prompt blocks are allocated (decode tokens
take no KV blocks here).
"""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from worker.engines.admission import BlockRequest, QueuedEngine
from worker.engines.base import (
    Admission,
    EngineStats,
    GenerationRequest,
    RequestRejectedError,
)
from worker.engines.compute import SharedCompute
from worker.kvcache import Allocation, PrefixCache

if TYPE_CHECKING:
    from worker.settings import WorkerSettings

WORDS = (
    "the", "of", "and", "cache", "block", "token", "prefix", "route", "worker", "model",
    "a", "to", "in", "is", "that", "for", "it", "as", "with", "on", "was", "by", "at", "from",
    "query", "answer", "memory", "page", "hash", "load", "queue", "time", "value", "state",
    "river", "stone", "light", "paper", "green", "quick", "small", "large", "north", "quiet",
)


@dataclass(frozen=True)
class SimCosts:
    """The simulated cost model (see module docstring)."""

    prefill_us_per_token: float = 200.0
    prefill_us_per_cached_token: float = 5.0
    decode_ms_per_token: float = 5.0
    prefill_shared: bool = False  # the requests in prefill share the engine's compute

    def prefill_seconds(self, uncached_tokens: int, cached_tokens: int) -> float:
        micros = (
            uncached_tokens * self.prefill_us_per_token
            + cached_tokens * self.prefill_us_per_cached_token
        )
        return micros / 1e6

    def decode_seconds(self, output_tokens: int) -> float:
        """Decode time of ``output_tokens`` tokens (the first one is free: it ends prefill)."""
        return max(output_tokens - 1, 0) * self.decode_ms_per_token / 1e3

    @classmethod
    def of(cls, settings: WorkerSettings) -> SimCosts:
        """The costs a worker started with ``settings`` simulates (so that a simulator of
        such workers reads them from the same arguments)."""
        return cls(
            prefill_us_per_token=settings.prefill_us_per_token,
            prefill_us_per_cached_token=settings.prefill_us_per_cached_token,
            decode_ms_per_token=settings.decode_ms_per_token,
            prefill_shared=settings.prefill_shared,
        )


def pseudo_words(prompt_tokens: Sequence[int], count: int, sample: int = 0) -> list[str]:
    """``count`` deterministic pseudo-words (each a leading-space piece), seeded by the prompt
    (and, for the samples of a request after its first, by the sample's number)."""
    seed = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(prompt_tokens)}q", *prompt_tokens))
    if sample:
        seed = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed, sample))
    rng = random.Random(seed)
    return [" " + rng.choice(WORDS) for _ in range(count)]


class SimGeneration:
    """One admitted request of the simulated engine."""

    def __init__(self, engine: SimEngine, request: GenerationRequest, admission: Admission,
                 awaits: Sequence[str] = ()):
        self._engine = engine
        self._request = request
        self._admission = admission
        self._awaits = awaits  # requests still computing blocks it reused (Reuse.SCHEDULED)

    @property
    def admission(self) -> Admission:
        return self._admission

    async def tokens(self) -> AsyncGenerator[str, None]:
        engine, request = self._engine, self._request
        costs, cache, rid = engine.costs, engine.cache, request.request_id
        await engine.prefill(self._admission.prefill_seconds, request.schedule_priority,
                             begun=lambda: cache.started(rid))
        await engine.computed_by(self._awaits)
        cache.computed(rid)
        engine.computing_done(rid)
        words = pseudo_words(request.prompt_tokens, request.max_tokens, request.sample)
        for i, word in enumerate(words):
            if i:
                await asyncio.sleep(costs.decode_ms_per_token / 1e3)
                engine.decode_seconds += costs.decode_ms_per_token / 1e3
            engine.generation_tokens += 1
            yield word


class SimEngine(QueuedEngine):
    """Simulated engine over a real :class:`PrefixCache` (see module docstring)."""

    def __init__(self, cache: PrefixCache, *, max_running: int, costs: SimCosts) -> None:
        super().__init__(cache, max_running)
        self.costs = costs
        self._compute = SharedCompute() if costs.prefill_shared else None
        # Under Reuse.SCHEDULED: the requests still computing blocks others reused, each
        # with the event its computation sets (what those others wait for).
        self._computing: dict[str, asyncio.Event] = {}

    async def prefill(self, seconds: float, priority: int = 0,
                      begun: Callable[[], None] | None = None) -> None:
        """A request's prefill: ``seconds`` of the engine alone, shared with the others in
        prefill when the costs say so (with those of the lowest ``priority`` present);
        ``begun`` is called when the engine begins it."""
        if self._compute is not None:
            await self._compute.run(seconds, priority, begun)
            return
        if begun is not None:
            begun()
        await asyncio.sleep(seconds)

    async def computed_by(self, requests: Sequence[str]) -> None:
        """Return once ``requests`` have computed their prompts (or ended)."""
        for rid in requests:
            if self.cache.computing(rid):
                event = self._computing.get(rid)
                if event is None:
                    event = self._computing[rid] = asyncio.Event()
                await event.wait()

    def computing_done(self, request_id: str) -> None:
        if (event := self._computing.pop(request_id, None)) is not None:
            event.set()

    @property
    def name(self) -> str:
        return "sim"

    def slots_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return prompt_tokens  # only prompt blocks are allocated

    def flush(self, namespace: str | None = None) -> int:
        return self.cache.flush(namespace)

    def info(self) -> dict[str, Any]:
        return {"costs": asdict(self.costs), "cache_reuse": str(self.cache.reuse)}

    def admission_for(self, alloc: Allocation) -> Admission:
        """The admission record (with its modelled prefill cost) of an allocation."""
        return Admission(
            request_id=alloc.request_id,
            input_tokens=alloc.num_tokens,
            matched_tokens=alloc.matched_tokens,
            matched_blocks=alloc.matched_blocks,
            prefill_seconds=self.costs.prefill_seconds(alloc.uncached_tokens, alloc.matched_tokens),
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._queue.running,
            waiting=self._queue.waiting,
            max_running=self.max_running,
            requests_admitted=self.requests_admitted,
            requests_finished=self.requests_finished,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            cache=self.cache.stats(),
        )

    @asynccontextmanager
    async def admit(self, request: GenerationRequest) -> AsyncIterator[SimGeneration]:
        if request.max_tokens < 1:
            raise RequestRejectedError("max_tokens must be >= 1")
        if self.cache.blocks_needed(len(request.prompt_tokens)) > self.cache.num_blocks:
            raise RequestRejectedError(
                f"prompt of {len(request.prompt_tokens)} tokens exceeds the KV cache "
                f"({self.capacity_tokens} tokens)"
            )
        alloc = await self._queue.acquire(
            BlockRequest(
                request.request_id,
                request.prompt_tokens,
                request.namespace,
                priority=request.priority,
                system_tokens=request.system_tokens,
            )
        )
        admission = self.admission_for(alloc)
        self.requests_admitted += 1
        self.prompt_tokens += alloc.num_tokens
        self.prefill_seconds += admission.prefill_seconds
        try:
            yield SimGeneration(self, request, admission, alloc.awaits)
        finally:
            self._queue.release(request.request_id)  # begun blocks count as computed
            self.computing_done(request.request_id)
