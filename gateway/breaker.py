"""Per-worker circuit breakers: eject a worker that keeps failing, probe it back in.

Closed (normal) -> ``failures`` consecutive failed attempts -> open: no request is routed there
for ``cooldown_s`` -> half-open: exactly one trial request may go there; its success closes the
breaker, its failure opens it again for twice the cooldown (up to ``max_cooldown_s``). A failure
is a worker that could not be reached, broke off, answered 5xx or sent nothing before the
first-byte timeout; a 4xx or 429 is an answer, not a failure.

Pure bookkeeping with ``now`` passed in (no clock, no I/O): the attempt loop asks which workers
are blocked and reports each attempt's outcome.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BreakerOptions:
    failures: int = 5  # consecutive failures that open the breaker; 0 disables breakers
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0


@dataclass(slots=True)
class _Breaker:
    failures: int = 0
    open_until: float = 0.0  # > 0 while open or half-open
    cooldown_s: float = 0.0
    trial: bool = False  # a half-open trial request is in flight


class Breakers:
    def __init__(self, options: BreakerOptions | None = None) -> None:
        self.options = options or BreakerOptions()
        self._by_worker: dict[str, _Breaker] = {}
        self.opened = 0  # times any breaker opened (exported as a metric)

    def state(self, wid: str, now: float) -> str:
        b = self._by_worker.get(wid)
        if b is None or not b.open_until:
            return "closed"
        return "open" if now < b.open_until or b.trial else "half_open"

    def blocked(self, now: float) -> frozenset[str]:
        """Workers no request may go to now: open breakers, and half-open ones whose trial is
        already in flight."""
        if not self._by_worker:
            return frozenset()
        return frozenset(w for w in self._by_worker if self.state(w, now) == "open")

    def attempt(self, wid: str, now: float) -> None:
        """A request goes to ``wid``; in half-open state it is the one trial."""
        b = self._by_worker.get(wid)
        if b is not None and b.open_until and now >= b.open_until:
            b.trial = True

    def success(self, wid: str) -> None:
        b = self._by_worker.get(wid)
        if b is None:
            return
        if b.open_until:
            log.info("worker %s: circuit breaker closed (trial request succeeded)", wid)
        del self._by_worker[wid]

    def failure(self, wid: str, now: float) -> None:
        if self.options.failures <= 0:
            return
        b = self._by_worker.setdefault(wid, _Breaker())
        b.failures += 1
        if b.open_until:  # a failed half-open trial: open again, for longer
            b.cooldown_s = min(2 * b.cooldown_s, self.options.max_cooldown_s)
        elif b.failures >= self.options.failures:
            b.cooldown_s = self.options.cooldown_s
            self.opened += 1
        else:
            return
        b.open_until = now + b.cooldown_s
        b.trial = False
        log.warning("worker %s: circuit breaker open for %.1fs after %d consecutive failures",
                    wid, b.cooldown_s, b.failures)

    def settled(self, wid: str) -> None:
        """The attempt at ``wid`` ended; one that ended with neither outcome (its client left)
        gives the half-open trial to the next request."""
        b = self._by_worker.get(wid)
        if b is not None:
            b.trial = False

    def forget(self, wid: str) -> None:
        self._by_worker.pop(wid, None)
