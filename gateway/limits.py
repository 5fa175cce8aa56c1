"""Admission limits: per-tenant token buckets and concurrency, and a global bounded queue.

* **Per tenant**: a token bucket on requests (``--tenant-rpm``) and one on tokens
  (``--tenant-tpm``; a request costs its prompt tokens plus ``max_tokens`` for every prompt and
  choice, as estimated at admission), each refilling continuously and holding up to a minute's
  worth; and a cap on requests in flight (``--tenant-concurrency``). A request larger than a
  whole bucket is admitted when the bucket is full and leaves it in debt, so it is not refused
  forever.
* **Global**: at most ``--max-inflight`` requests run at once; later ones wait in a FIFO queue
  of at most ``--max-queue`` for up to ``--admission-timeout-s``. And the request bodies the
  gateway holds at once, from before each is read until it is answered, add up to at most
  ``--max-held-body-bytes`` (:class:`BodyBudget`): what bounds the gateway's memory when many
  clients send large bodies, whatever their number.

Over any limit the request is refused at once with 429 and ``Retry-After`` (seconds until the
bucket holds enough, or 1 for concurrency and queue limits). What can be refused whatever a
request costs (a tenant's concurrency cap, an empty request bucket, a token bucket without a
token, a full queue) is refused before its body is read (:meth:`Limits.check`), so a tenant
over its limits cannot make the gateway read and parse bodies it would refuse.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gateway.errors import GatewayError

_MAX_TENANTS = 100_000  # buckets kept; the least recently seen are forgotten beyond this


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(message, code=code, headers={"Retry-After": str(seconds)})
        self.retry_after_s = seconds


class TokenBucket:
    """``rate`` units per second, holding at most ``capacity``."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return the seconds to wait."""
        wait = self.wait(amount, now)
        if not wait:
            self.level -= amount
        return wait

    def wait(self, amount: float, now: float) -> float:
        """Seconds until the bucket can give ``amount`` (0: now), taking nothing."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True, slots=True)
class LimitOptions:
    tenant_rpm: float = 0.0
    tenant_tpm: float = 0.0
    tenant_concurrency: int = 0
    max_inflight: int = 0
    max_queue: int = 256
    queue_timeout_s: float = 10.0
    max_held_body_bytes: int = 0


class BodyBudget:
    """Request body bytes held at once, gateway-wide, at most ``limit`` (0: no limit).

    A request takes what its ``Content-Length`` declares before any of its body is read (a
    chunked body, each chunk as it arrives) and gives it back when it is answered
    (:class:`BodyHold`): while it waits and runs it keeps its body, decoded, to forward, so
    the bytes as received are the measure (the decoded form is a multiple of them). One that
    does not fit is refused with 429 (``server_overloaded``) before the bytes that would not
    fit are read."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("the body budget must be >= 0")
        self.limit = limit
        self.held = 0
        self.refused = 0

    def hold(self, declared: int | None) -> BodyHold:
        """A hold on ``declared`` bytes (None: nothing yet, a chunked body), or
        :class:`RateLimited` when they do not fit."""
        held = BodyHold(self)
        if declared:
            held.grow(declared)
        return held

    def refusal(self, size: int) -> RateLimited:
        self.refused += 1
        return RateLimited(
            f"the gateway holds as many request bytes as it may ({self.limit} bytes); "
            f"a body of {size} bytes more does not fit now, retry shortly",
            retry_after_s=1, code="server_overloaded")


class BodyHold:
    """One request's share of a :class:`BodyBudget`; :meth:`release` once, when answered."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def grow(self, size: int) -> None:
        """Take ``size`` bytes more, or raise :class:`RateLimited` (taking nothing)."""
        budget = self._budget
        if budget.limit and budget.held + size > budget.limit:
            raise budget.refusal(self.size + size)
        budget.held += size
        self.size += size

    def release(self) -> None:
        self._budget.held -= self.size
        self.size = 0


class _Buckets:
    __slots__ = ("requests", "tokens")

    def __init__(self, requests: TokenBucket | None, tokens: TokenBucket | None) -> None:
        self.requests = requests
        self.tokens = tokens


class TenantLimiter:
    def __init__(self, opts: LimitOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self._opts = opts
        self._clock = clock
        self._buckets: OrderedDict[str, _Buckets] = OrderedDict()
        self.inflight: dict[str, int] = {}

    def _of(self, tenant: str, now: float) -> _Buckets:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            rpm, tpm = self._opts.tenant_rpm, self._opts.tenant_tpm
            buckets = _Buckets(TokenBucket(rpm / 60, rpm, now) if rpm else None,
                               TokenBucket(tpm / 60, tpm, now) if tpm else None)
            self._buckets[tenant] = buckets
            if len(self._buckets) > _MAX_TENANTS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(tenant)
        return buckets

    def check(self, tenant: str) -> None:
        """Raise :class:`RateLimited` now for a request of ``tenant`` that :meth:`admit` would
        refuse whatever it costs (its requests in flight at the cap, its request bucket
        empty, its token bucket without a token), taking nothing. Called before a body is
        read: a tenant over its limits does not make the gateway read and parse requests it
        would refuse."""
        self._check_concurrency(tenant)
        buckets = self._buckets.get(tenant)
        if buckets is None:
            return
        now = self._clock()
        if buckets.requests is not None and (wait := buckets.requests.wait(1, now)):
            raise self._over_rpm(wait)
        if buckets.tokens is not None and (wait := buckets.tokens.wait(1, now)):
            raise RateLimited(
                f"rate limit reached: {self._opts.tenant_tpm:g} tokens per minute; retry in "
                f"{math.ceil(wait)} s", retry_after_s=wait)

    def _check_concurrency(self, tenant: str) -> None:
        cap = self._opts.tenant_concurrency
        if cap and self.inflight.get(tenant, 0) >= cap:
            raise RateLimited(f"too many requests in flight for this key (limit {cap})",
                              retry_after_s=1, code="concurrency_limit_exceeded")

    def _over_rpm(self, wait: float) -> RateLimited:
        return RateLimited(f"rate limit reached: {self._opts.tenant_rpm:g} requests per minute; "
                           f"retry in {math.ceil(wait)} s", retry_after_s=wait)

    def admit(self, tenant: str, tokens: int) -> None:
        """Count one request of ``tokens`` for ``tenant``, or raise :class:`RateLimited`."""
        self._check_concurrency(tenant)
        now = self._clock()
        buckets = self._of(tenant, now)
        if buckets.requests is not None:
            wait = buckets.requests.take(1, now)
            if wait:
                raise self._over_rpm(wait)
        if buckets.tokens is not None:
            wait = buckets.tokens.take(tokens, now)
            if wait:
                if buckets.requests is not None:
                    buckets.requests.give_back(1)
                raise RateLimited(
                    f"rate limit reached: {self._opts.tenant_tpm:g} tokens per minute, this "
                    f"request counts {tokens}; retry in {math.ceil(wait)} s",
                    retry_after_s=wait)
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1

    def refund(self, tenant: str, tokens: int) -> None:
        """Undo :meth:`admit`'s bucket charges (the request was refused after all)."""
        buckets = self._buckets.get(tenant)
        if buckets is not None:
            if buckets.requests is not None:
                buckets.requests.give_back(1)
            if buckets.tokens is not None:
                buckets.tokens.give_back(tokens)

    def release(self, tenant: str) -> None:
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)


def _queue_full() -> RateLimited:
    return RateLimited("the gateway is at capacity and its queue is full; retry shortly",
                       retry_after_s=1, code="server_overloaded")


class AdmissionQueue:
    """At most ``max_inflight`` holders; up to ``max_queue`` more wait, first come first
    served, each for at most ``timeout_s``."""

    def __init__(self, max_inflight: int, max_queue: int, timeout_s: float) -> None:
        self._max = max_inflight
        self._max_queue = max_queue
        self._timeout_s = timeout_s
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def check(self) -> None:
        """Raise :class:`RateLimited` now if a request would find every place taken and the
        queue full, taking nothing (before its body is read)."""
        if self._max and self.inflight >= self._max and self.queued >= self._max_queue:
            raise _queue_full()

    def take_free(self) -> bool:
        """Take a place if one is free now with nobody waiting (or there is no limit); False
        when the caller must :meth:`acquire`."""
        if not self._max:
            return True
        if self.inflight < self._max and (not self._waiters or not self.queued):
            self.inflight += 1
            return True
        return False

    async def acquire(self) -> None:
        if not self._max:
            return
        if self.inflight < self._max and not self.queued:
            self.inflight += 1
            return
        if self.queued >= self._max_queue:
            raise _queue_full()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot came just as we gave up: pass it on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise RateLimited(
                f"the gateway is at capacity; waited {self._timeout_s:g} s in its queue",
                retry_after_s=1, code="server_overloaded") from None

    def release(self) -> None:
        if not self._max:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot goes straight to the next in line
                return
        self.inflight -= 1


class Limits:
    def __init__(self, opts: LimitOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenants = TenantLimiter(opts, clock)
        self.queue = AdmissionQueue(opts.max_inflight, opts.max_queue, opts.queue_timeout_s)
        self.bodies = BodyBudget(opts.max_held_body_bytes)
        self._limited = bool(opts.tenant_rpm or opts.tenant_tpm or opts.tenant_concurrency
                             or opts.max_inflight)

    def check(self, tenant: str) -> None:
        """Refuse now what :meth:`admitted` would refuse for any cost (before the body is read
        and parsed); takes nothing."""
        if self._limited:
            self.tenants.check(tenant)
            self.queue.check()

    def admitted(self, tenant: str, tokens: int) -> Admission:
        """Hold a place for one request while the ``async with`` block runs (entering raises
        :class:`RateLimited` if there is none)."""
        return Admission(self, tenant, tokens)


class Admission:
    """One request's place (:meth:`Limits.admitted`): an ``async with`` without a generator,
    as it wraps every request."""

    __slots__ = ("_limits", "_tenant", "_tokens")

    def __init__(self, limits: Limits, tenant: str, tokens: int) -> None:
        self._limits = limits
        self._tenant = tenant
        self._tokens = tokens

    async def __aenter__(self) -> None:
        limits, tenant = self._limits, self._tenant
        limits.tenants.admit(tenant, self._tokens)
        queue = limits.queue
        if queue.take_free():
            return
        try:
            await queue.acquire()
        except BaseException:
            limits.tenants.release(tenant)
            limits.tenants.refund(tenant, self._tokens)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._limits.queue.release()
        self._limits.tenants.release(self._tenant)


LIMITS_KEY = web.AppKey("limits", Limits)
