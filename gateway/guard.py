"""What stands between the attempt loop and a worker that misbehaves.

* :class:`ConnectionSlots`: how many upstream connections may be in use, in total and per
  worker; a request waits for one at most ``queue_timeout_s`` (then 503 with ``Retry-After``,
  instead of queueing without bound inside the HTTP client's pool).
* :func:`first_byte`: the worker's reply (its status line) must arrive within the first-byte
  timeout, and before the health probes find that worker down; otherwise the attempt is given
  up (its connection closed, so the worker drops the request) and the request goes elsewhere.
  A worker that hangs (SIGSTOP, a wedged engine) thus holds requests for seconds, not for the
  read timeout.
* :class:`~gateway.breaker.Breakers`: consecutive failures eject a worker for a while.
* :class:`Liveness`: when each worker last sent this gateway a reply or a stream chunk. A health
  probe that only timed out does not mark down a worker that keeps answering real requests: a
  burst that keeps a worker (or this gateway's event loop) busy for a few seconds delays probe
  answers, and a false "down" would throw away the requests waiting on it and its cache index.
* ``stream_idle_timeout_s``: a stream whose worker sends nothing for that long, once its first
  chunk arrived, is ended with an SSE error event and its connection closed (a worker that
  hangs mid-stream would otherwise hold it for the read timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.breaker import BreakerOptions, Breakers
from gateway.pool import WorkerPool

T = TypeVar("T")


class SlotTimeout(Exception):
    """No upstream connection became free in time (``scope``: "gateway" or the worker id)."""

    def __init__(self, scope: str, waited_s: float) -> None:
        super().__init__(f"no free connection to {scope} within {waited_s:g}s")
        self.scope = scope


class NoFirstByte(Exception):
    """The worker sent nothing in time, or was found down while we waited."""


Release = Callable[[], None]


class ConnectionSlots:
    def __init__(self, total: int, per_worker: int, queue_timeout_s: float) -> None:
        self._total = asyncio.Semaphore(total)
        self._per_worker_limit = per_worker
        self._per_worker: dict[str, asyncio.Semaphore] = {}
        self.queue_timeout_s = queue_timeout_s

    async def _take(self, sem: asyncio.Semaphore, scope: str) -> None:
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await sem.acquire()
        except TimeoutError:
            raise SlotTimeout(scope, self.queue_timeout_s) from None

    async def take(self, wid: str) -> Release:
        """One connection to ``wid``; call the returned function once it is no longer used."""
        sem = self._per_worker.get(wid)
        if sem is None:
            sem = self._per_worker[wid] = asyncio.Semaphore(self._per_worker_limit)
        await self._take(self._total, "the workers")
        try:
            await self._take(sem, wid)
        except BaseException:
            self._total.release()
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                sem.release()
                self._total.release()

        return release


class Ejections:
    """Futures that complete when a worker is found down (by a probe or a failed attempt)."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future[str]]] = {}

    @contextlib.contextmanager
    def watch(self, wid: str) -> Iterator[asyncio.Future[str]]:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(wid, set()).add(future)
        try:
            yield future
        finally:
            waiters = self._waiters.get(wid)
            if waiters is not None:
                waiters.discard(future)
                if not waiters:
                    del self._waiters[wid]
            future.cancel()

    def eject(self, wid: str, reason: str) -> None:
        for future in self._waiters.pop(wid, set()):
            if not future.done():
                future.set_result(reason)


async def first_byte(opening: Awaitable[T], timeout_s: float, ejected: asyncio.Future[str]) -> T:
    """``opening`` (the request up to the reply's status line), given up after ``timeout_s``
    (0: no limit) or once ``ejected`` completes; giving up cancels it, which closes its
    connection."""
    task = asyncio.ensure_future(opening)
    either: set[asyncio.Future[Any]] = {task, ejected}
    try:
        done, _ = await asyncio.wait(
            either, timeout=timeout_s or None, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    if not task.cancelled() and (task in done or task.exception() is None):
        return task.result()  # it arrived (possibly just as we gave up): use it
    if ejected.done() and not ejected.cancelled():
        raise NoFirstByte(f"found down while waiting: {ejected.result()}")
    raise NoFirstByte(f"nothing received within the first-byte timeout ({timeout_s:g}s)")


class Liveness:
    """When each worker last sent this gateway something on a request (monotonic seconds)."""

    def __init__(self) -> None:
        self._heard: dict[str, float] = {}

    def heard(self, wid: str, now: float) -> None:
        self._heard[wid] = now

    def heard_since(self, wid: str, since: float) -> bool:
        return self._heard.get(wid, -math.inf) >= since


@dataclass(slots=True)
class UpstreamGuard:
    slots: ConnectionSlots
    first_byte_timeout_s: float = 0.0
    stream_idle_timeout_s: float = 0.0  # 0: only the read timeout
    breakers: Breakers = field(default_factory=lambda: Breakers(BreakerOptions()))
    ejections: Ejections = field(default_factory=Ejections)
    liveness: Liveness = field(default_factory=Liveness)

    async def open(self, wid: str, opening: Awaitable[T]) -> T:
        """``opening`` under the first-byte timeout, given up if ``wid`` is found down."""
        with self.ejections.watch(wid) as ejected:
            return await first_byte(opening, self.first_byte_timeout_s, ejected)

    def blocked(self, pool: WorkerPool, now: float) -> frozenset[str]:
        """Workers whose breaker keeps requests away now; none if that is every healthy one
        (with the whole pool failing, trying beats refusing)."""
        blocked = self.breakers.blocked(now)
        if blocked and not any(s.healthy and s.worker.id not in blocked for s in pool.states()):
            return frozenset()
        return blocked
