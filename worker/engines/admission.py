"""FIFO admission of requests onto a :class:`~worker.kvcache.PrefixCache` (shared by engines).

At most ``max_running`` requests hold blocks at once; the rest wait in a FIFO queue, head-of-line:
a request that cannot get its KV blocks keeps the ones behind it waiting too. Everything runs on
the event loop (no threads, no locks): the cache is only ever touched from the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from worker.kvcache import Allocation, CacheFullError, PrefixCache, Priority


@dataclass(frozen=True)
class BlockRequest:
    """What to allocate for one request (the arguments of :meth:`PrefixCache.allocate`)."""

    request_id: str
    tokens: Sequence[int]
    namespace: str = ""
    priority: Priority = Priority.CONVERSATION
    system_tokens: int = 0
    reserve_tokens: int = 0

    def allocate(self, cache: PrefixCache) -> Allocation:
        return cache.allocate(
            self.request_id,
            self.tokens,
            self.namespace,
            priority=self.priority,
            system_tokens=self.system_tokens,
            reserve_tokens=self.reserve_tokens,
        )


@dataclass
class _Waiter:
    ask: BlockRequest
    future: asyncio.Future[Allocation]


class AdmissionQueue:
    """Running slots + FIFO waiting queue in front of a prefix cache."""

    def __init__(self, cache: PrefixCache, max_running: int) -> None:
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.cache = cache
        self.max_running = max_running
        self._waiting: deque[_Waiter] = deque()
        self._running = 0
        self.requests_finished = 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def fits(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` token slots could ever be allocated (an empty pool)."""
        return self.cache.blocks_needed(num_tokens) <= self.cache.num_blocks

    async def acquire(self, ask: BlockRequest) -> Allocation:
        """Wait for a running slot and the blocks; the caller must :meth:`release` them."""
        if not self._waiting and self._running < self.max_running:
            try:
                alloc = ask.allocate(self.cache)
            except CacheFullError:
                pass
            else:
                self._running += 1
                return alloc
        waiter = _Waiter(ask, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                # Admitted in the same tick as the cancellation: give the slot back.
                self.release(ask.request_id)
            else:
                # Still queued, unless a pump already dropped it as cancelled.
                with contextlib.suppress(ValueError):
                    self._waiting.remove(waiter)
                self._pump()
            raise

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)
        self._running -= 1
        self.requests_finished += 1
        self._pump()

    def _pump(self) -> None:
        """Admit waiting requests in FIFO order while slots and blocks allow."""
        while self._waiting and self._running < self.max_running:
            head = self._waiting[0]
            if head.future.done():
                # Cancelled, its task not yet resumed (a burst of clients leaving in one tick):
                # it gets no slot and no blocks; its own cleanup finds it gone.
                self._waiting.popleft()
                continue
            try:
                alloc = head.ask.allocate(self.cache)
            except CacheFullError:
                return
            self._waiting.popleft()
            self._running += 1
            head.future.set_result(alloc)


class QueuedEngine:
    """What every engine over an :class:`AdmissionQueue` shares: the cache, the queue, the
    counters behind ``EngineStats`` and the queue gauges."""

    def __init__(self, cache: PrefixCache, max_running: int) -> None:
        self.cache = cache
        self.max_running = max_running
        self._queue = AdmissionQueue(cache, max_running)
        self.requests_admitted = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0

    @property
    def capacity_tokens(self) -> int:
        return self.cache.num_blocks * self.cache.block_size

    def restart_in_place(self) -> int:
        """What a restart of this engine behind the same address leaves, without one: the
        cache empty (:meth:`PrefixCache.flush`) and the counters behind ``EngineStats`` back
        to zero; the requests running now go on. Returns the blocks dropped."""
        dropped = self.cache.flush()
        self.cache.zero_counters()
        self._queue.requests_finished = 0
        self.requests_admitted = self.prompt_tokens = self.generation_tokens = 0
        self.prefill_seconds = self.decode_seconds = 0.0
        return dropped

    @property
    def running(self) -> int:
        return self._queue.running

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    @property
    def requests_finished(self) -> int:
        return self._queue.requests_finished
