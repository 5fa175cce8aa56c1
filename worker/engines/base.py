"""The engine interface the HTTP server talks to.

An engine admits a request (FIFO, bounded concurrency, KV blocks allocated), which fixes its cache
statistics (:class:`Admission`), then yields generated text pieces, then releases the blocks.
``admit`` is an async context manager so blocks are released even when the client goes away.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from worker.kvcache import CacheStats


class RequestRejectedError(ValueError):
    """The request can never run on this engine (for example, larger than the whole cache)."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: Sequence[int]
    max_tokens: int
    namespace: str = ""


@dataclass(frozen=True)
class Admission:
    """What the cache gave a request, known right after its blocks were allocated."""

    request_id: str
    input_tokens: int
    matched_tokens: int
    matched_blocks: int
    prefill_seconds: float
    """Prefill time the engine charges for this request (simulated engines: the cost model)."""

    @property
    def cache_hit_ratio(self) -> float:
        return self.matched_tokens / self.input_tokens if self.input_tokens else 0.0


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    max_running: int
    requests_admitted: int
    requests_finished: int
    prompt_tokens: int
    generation_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cache: CacheStats


class Generation(Protocol):
    """An admitted request."""

    @property
    def admission(self) -> Admission: ...

    def tokens(self) -> AsyncIterator[str]:
        """Generated text pieces, one per output token, at the engine's pace."""
        ...


class Engine(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def capacity_tokens(self) -> int:
        """Longest prompt that can ever be admitted (the whole KV pool)."""
        ...

    def admit(self, request: GenerationRequest) -> AbstractAsyncContextManager[Generation]:
        """Wait for a running slot and KV blocks; release them on exit.

        Raises :class:`RequestRejectedError` on entry when the request can never fit.
        """
        ...

    def stats(self) -> EngineStats: ...
