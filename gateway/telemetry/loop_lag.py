"""How late the event loop runs what is due: the gateway's own saturation signal.

Every ``interval_s`` a timer falls due; the time between when it was due and when the loop
ran it is the lag, observed into ``gateway_event_loop_lag_seconds``. Everything else the loop
does waits the same way: a request's next step (its parse, its write to a worker, the relay
of the answer) starts that late. The lag grows when the process has more ready work than one
core runs (callbacks queue behind each other) and when the kernel runs other processes
instead of it (a core shared with workers or other services); on a gateway with CPU to spare
it stays within a millisecond or two (uvloop's timers have a millisecond's resolution). A lag
of tens of milliseconds that lasts says the gateway itself is the bottleneck: give it a core
of its own, more processes (``--procs``) or more replicas.

One timer per interval, no task and no thread: nothing on the request path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL_S = 0.25  # how often the lag is sampled
# Seconds: the lowest bucket holds the timer's own resolution (uvloop rounds to milliseconds).
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    """Observes the lag of a timer re-armed every ``interval_s`` on the running loop, from
    :meth:`start` until :meth:`stop`."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._observe = observe
        self._interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Arm the first timer on the running loop (a second start is a no-op)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._arm(self._loop.time())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self._interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self._observe(max(0.0, now - self._due))  # a timer may fire within its resolution early
        self._arm(now)
