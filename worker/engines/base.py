"""The engine interface the HTTP server talks to.

An engine admits a request (FIFO, bounded concurrency, KV blocks allocated), which fixes its cache
statistics (:class:`Admission`), then yields generated text pieces, then releases the blocks.
``admit`` is an async context manager so blocks are released even when the client goes away.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from worker.kvcache import CacheStats, Priority


class EngineUnavailableError(RuntimeError):
    """The configured engine cannot be built (missing optional package, bad model files)."""


class RequestRejectedError(ValueError):
    """The request can never run on this engine (for example, larger than the whole cache)."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: Sequence[int]
    max_tokens: int
    namespace: str = ""
    priority: Priority = Priority.CONVERSATION
    """Eviction class of the prompt's cached blocks."""
    system_tokens: int = 0
    """Leading prompt tokens that are system prompt (their full blocks get ``SYSTEM``)."""
    sample: int = 0
    """Which of a request's ``n`` samples of this prompt (each its own output)."""
    schedule_priority: int = 0
    """vLLM's ``priority`` (lower first): engines that share prefill compute give it to the
    lowest present (the simulated engine, ``--prefill-shared``)."""


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

    def tokens(self) -> AsyncGenerator[str, None]:
        """Generated text pieces, one per output token, at the engine's pace (closed early
        when the output reached a stop string: the engine generates no more for it)."""
        ...


class Engine(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def capacity_tokens(self) -> int:
        """Longest prompt that can ever be admitted (the whole KV pool)."""
        ...

    def slots_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV token slots a request holds while it runs (compared with ``capacity_tokens``)."""
        ...

    def admit(self, request: GenerationRequest) -> AbstractAsyncContextManager[Generation]:
        """Wait for a running slot and KV blocks; release them on exit.

        Raises :class:`RequestRejectedError` on entry when the request can never fit.
        """
        ...

    def stats(self) -> EngineStats: ...

    def flush(self, namespace: str | None = None) -> int:
        """Drop cached prefixes (of one namespace, or all); returns the blocks dropped."""
        ...

    def restart_in_place(self) -> int:
        """Empty the cache and set the counters back to zero, as a restart would leave them
        (the running requests go on); returns the blocks dropped."""
        ...

    def info(self) -> dict[str, Any]:
        """Engine-specific facts for ``/stats`` (model size, KV dtype and bytes, ...)."""
        ...
