"""What stands between the attempt loop and a worker that misbehaves.

* :class:`ConnectionSlots`: how many upstream connections may be in use, in total and per
  worker; a request waits for one at most ``queue_timeout_s`` (then 503 with ``Retry-After``,
  instead of queueing without bound inside the HTTP client's pool).
* :class:`FirstByteWaits`: the worker's reply (its status line) must arrive within the first-byte
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
from collections import OrderedDict, deque
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


class _Wait:
    """One attempt waiting for its worker's first byte (:class:`FirstByteWaits`)."""

    __slots__ = ("cancelling", "due", "task", "why", "wid")

    def __init__(self, task: asyncio.Task[object], wid: str, due: float) -> None:
        self.task = task
        self.wid = wid
        self.due = due
        self.cancelling = task.cancelling()  # the task's cancel requests before this wait
        self.why = ""  # why it was given up; "" while it was not


class FirstByteWaits:
    """The attempts waiting for their worker's reply (its status line), each given up after
    ``timeout_s`` (0: no limit) or once its worker is found down (:meth:`eject`); giving up
    cancels the attempt, which closes its connection.

    Every attempt waits the same time, so the deadlines fall in the order the waits began:
    they are kept in that order (an ordered dict: an entry added and removed per request)
    under one timer, armed for the first deadline and re-armed for the next when it fires.
    A timer per request (``asyncio.timeout``) is made and cancelled on every relayed
    request, which on uvloop costs about 5 us, more than the rest of the wait's bookkeeping."""

    def __init__(self, timeout_s: float = 0.0) -> None:
        if timeout_s < 0:
            raise ValueError("timeout_s must be >= 0")
        self.timeout_s = timeout_s
        self._waits: OrderedDict[_Wait, None] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None

    async def wait(self, opening: Awaitable[T], wid: str) -> T:
        """``opening`` (the request up to the reply's status line) in the caller's task,
        given up as the class says (:class:`NoFirstByte`)."""
        task = asyncio.current_task()
        assert task is not None, "a first-byte wait runs in a task"
        loop = asyncio.get_running_loop()
        entry = _Wait(task, wid, loop.time() + self.timeout_s if self.timeout_s else math.inf)
        self._waits[entry] = None
        if self.timeout_s and self._timer is None:
            self._timer = loop.call_at(entry.due, self._due)
        answered = False  # our cancel request withdrawn (as asyncio.timeout withdraws its own)
        try:
            return await opening
        except asyncio.CancelledError:
            if entry.why:
                answered = True
                # Given up by us, and no other cancel request came meanwhile: ours to answer.
                if task.uncancel() <= entry.cancelling:
                    raise NoFirstByte(entry.why) from None
            raise
        finally:
            self._waits.pop(entry, None)
            if entry.why and not answered:
                task.uncancel()  # given up, but the opening ended another way first

    def eject(self, wid: str, reason: str) -> None:
        """``wid`` was found down: every attempt waiting on it is given up."""
        for entry in [e for e in self._waits if e.wid == wid]:
            self._give_up(entry, f"found down while waiting: {reason}")

    def _due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        waits = self._waits
        while waits:
            first = next(iter(waits))
            if first.due > now:
                self._timer = loop.call_at(first.due, self._due)
                return
            self._give_up(first, "nothing received within the first-byte timeout "
                                 f"({self.timeout_s:g}s)")

    def _give_up(self, entry: _Wait, why: str) -> None:
        del self._waits[entry]
        entry.why = why
        entry.task.cancel()


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
    liveness: Liveness = field(default_factory=Liveness)
    waits: FirstByteWaits = field(init=False)

    def __post_init__(self) -> None:
        self.waits = FirstByteWaits(self.first_byte_timeout_s)

    async def open(self, wid: str, opening: Awaitable[T]) -> T:
        """``opening`` under the first-byte timeout, given up if ``wid`` is found down."""
        return await self.waits.wait(opening, wid)

    def blocked(self, pool: WorkerPool, now: float) -> frozenset[str]:
        """Workers whose breaker keeps requests away now; none if that is every healthy one
        (with the whole pool failing, trying beats refusing)."""
        blocked = self.breakers.blocked(now)
        if blocked and not any(s.healthy and s.worker.id not in blocked for s in pool.states()):
            return frozenset()
        return blocked
