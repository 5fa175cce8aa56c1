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
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

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


class _Gate:
    """A counting semaphore for the event loop's thread, first come first served: a free place
    is taken with a plain call (no coroutine, no timer), a busy one waits in line."""

    __slots__ = ("_waiters", "free")

    def __init__(self, size: int) -> None:
        self.free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def wait(self, timeout_s: float, scope: str) -> None:
        """Wait in line for a place, at most ``timeout_s`` (then :class:`SlotTimeout`)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.give()  # the place came just as we gave up: pass it on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise SlotTimeout(scope, timeout_s) from None
            raise

    def give(self) -> None:
        """A place is free again: it goes straight to the first in line, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class ConnectionSlots:
    def __init__(self, total: int, per_worker: int, queue_timeout_s: float) -> None:
        self._total = _Gate(total)
        self._per_worker_limit = per_worker
        self._per_worker: dict[str, _Gate] = {}
        self.queue_timeout_s = queue_timeout_s

    def try_take(self, wid: str) -> Release | None:
        """One connection to ``wid`` if one is free now, without waiting (None: none is)."""
        gate = self._gate(wid)
        total = self._total
        if not total.try_take():
            return None
        if not gate.try_take():
            total.give()
            return None
        return _releaser(gate, total)

    async def take(self, wid: str) -> Release:
        """One connection to ``wid``; call the returned function once it is no longer used."""
        gate = self._gate(wid)
        total = self._total
        if not total.try_take():
            await total.wait(self.queue_timeout_s, "the workers")
        if not gate.try_take():
            try:
                await gate.wait(self.queue_timeout_s, wid)
            except BaseException:
                total.give()
                raise
        return _releaser(gate, total)

    def _gate(self, wid: str) -> _Gate:
        gate = self._per_worker.get(wid)
        if gate is None:
            gate = self._per_worker[wid] = _Gate(self._per_worker_limit)
        return gate


def _releaser(gate: _Gate, total: _Gate) -> Release:
    """Gives the places back, once however often it is called."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            gate.give()
            total.give()

    return release


class Ejections:
    """Who to tell when a worker is found down (by a probe or a failed attempt)."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[Callable[[str], None]]] = {}

    def watch(self, wid: str, on_eject: Callable[[str], None]) -> None:
        """``on_eject(reason)`` is called if ``wid`` is ejected before :meth:`unwatch`."""
        waiters = self._waiters.get(wid)
        if waiters is None:
            waiters = self._waiters[wid] = set()
        waiters.add(on_eject)

    def unwatch(self, wid: str, on_eject: Callable[[str], None]) -> None:
        waiters = self._waiters.get(wid)
        if waiters is not None:
            waiters.discard(on_eject)
            if not waiters:
                del self._waiters[wid]

    def eject(self, wid: str, reason: str) -> None:
        for on_eject in self._waiters.pop(wid, set()):
            on_eject(reason)


async def first_byte(opening: Awaitable[T], timeout_s: float, ejections: Ejections,
                     wid: str) -> T:
    """``opening`` (the request up to the reply's status line), given up after ``timeout_s``
    (0: no limit) or once ``wid`` is ejected; giving up cancels it, which closes its
    connection. It runs in the caller's task under one timer (no task of its own): an
    ejection moves the timer's deadline to now."""
    timer = asyncio.timeout(timeout_s or None)
    ejected: list[str] = []

    def on_eject(reason: str) -> None:
        if not ejected and not timer.expired():
            ejected.append(reason)
            timer.reschedule(asyncio.get_running_loop().time())

    ejections.watch(wid, on_eject)
    try:
        async with timer:
            return await opening
    except TimeoutError:
        if not timer.expired():
            raise  # the opening's own timeout, not ours
        if ejected:
            raise NoFirstByte(f"found down while waiting: {ejected[0]}") from None
        raise NoFirstByte(
            f"nothing received within the first-byte timeout ({timeout_s:g}s)") from None
    finally:
        ejections.unwatch(wid, on_eject)


class IdleTimer:
    """A stream's idle timeout (the longest wait for its next chunk) with one timer for the
    whole stream instead of one per chunk: :meth:`wait` before each wait notes when it began
    and arms the timer only if none is armed; when the timer fires early (the stream moved on
    meanwhile) it re-arms itself for the current wait's deadline. A wait past its deadline
    cancels the task that created the timer, as ``asyncio.timeout`` does; the caller turns the
    ``CancelledError`` into its timeout when :meth:`timed_out` says it was this timer's. Only
    the waits are timed: the time between :meth:`heard` and the next :meth:`wait` (writing to
    the client) is not. :meth:`close` once the stream ends, however it ends."""

    __slots__ = (
        "_base",
        "_handle",
        "_loop",
        "_since",
        "_task",
        "_waiting",
        "expired",
        "idle_s",
    )

    def __init__(self, idle_s: float) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("IdleTimer needs a running task")
        self._loop = asyncio.get_running_loop()
        self._task = task
        self._base = task.cancelling()  # cancellations pending before ours: not ours
        self.idle_s = idle_s
        self._since = 0.0
        self._waiting = False
        self._handle: asyncio.TimerHandle | None = None
        self.expired = False

    def wait(self) -> None:
        """The caller starts waiting for the next chunk."""
        self._since = self._loop.time()
        self._waiting = True
        if self._handle is None and not self.expired:
            self._handle = self._loop.call_at(self._since + self.idle_s, self._fire)

    def heard(self) -> None:
        """The chunk came: the wait is over."""
        self._waiting = False

    def timed_out(self) -> bool:
        """Whether the ``CancelledError`` the caller caught came from this timer alone."""
        return self.expired and self._task.uncancel() <= self._base

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._waiting = False

    def _fire(self) -> None:
        self._handle = None
        if not self._waiting:
            return  # armed again by the next wait
        due = self._since + self.idle_s
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._fire)
            return
        self.expired = True
        self._task.cancel()


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
        return await first_byte(opening, self.first_byte_timeout_s, self.ejections, wid)

    def blocked(self, pool: WorkerPool, now: float) -> frozenset[str]:
        """Workers whose breaker keeps requests away now; none if that is every healthy one
        (with the whole pool failing, trying beats refusing)."""
        blocked = self.breakers.blocked(now)
        if blocked and not any(s.healthy and s.worker.id not in blocked for s in pool.states()):
            return frozenset()
        return blocked
