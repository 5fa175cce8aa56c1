"""One engine's prefill compute, shared by the requests in prefill (processor sharing).

A real engine runs the prompts it admitted together, in the same steps: while ``n`` requests
are in prefill each gets about ``1/n`` of the engine's compute, so a worker given more work
than the others answers everything on it later. The simulated engine models that when asked
(``--prefill-shared``): each request's prefill is an amount of *work* (the seconds it would
take alone, :meth:`SimCosts.prefill_seconds`), and the work of the requests in prefill is done
at one unit per second in all, split evenly between them. Without it every prefill takes its
own time whatever else runs, so a loaded worker is no slower than an idle one.

:class:`ProcessorSharing` is the bookkeeping, on explicit times; :class:`SharedCompute` runs it
on the event loop's clock, one timer for the next prefill to end.
"""

from __future__ import annotations

import asyncio
import itertools

_DONE_S = 1e-9  # work left below this is done (float rounding)


class ProcessorSharing:
    """Jobs each with work left (seconds of the engine alone), all progressing at ``1/n``."""

    def __init__(self) -> None:
        self._left: dict[int, float] = {}
        self._at = 0.0  # when the work left was last brought up to date

    def __len__(self) -> int:
        return len(self._left)

    def advance(self, now: float) -> list[int]:
        """Bring the work left up to ``now``; the jobs done by then, removed."""
        if self._left and now > self._at:
            share = (now - self._at) / len(self._left)
            for job in self._left:
                self._left[job] -= share
        self._at = max(self._at, now)
        done = [job for job, left in self._left.items() if left <= _DONE_S]
        for job in done:
            del self._left[job]
        return done

    def add(self, job: int, work_s: float, now: float) -> list[int]:
        """``job`` starts at ``now`` with ``work_s`` seconds of work; the jobs done by then
        (a timer that fires late), removed."""
        done = self.advance(now)
        self._left[job] = work_s
        return done

    def remove(self, job: int, now: float) -> list[int]:
        """``job`` leaves before its end (its request was given up); the others done by then,
        removed."""
        done = self.advance(now)
        self._left.pop(job, None)
        return [other for other in done if other != job]

    def next_end(self) -> float | None:
        """When the next job ends if none starts before (None: no job)."""
        if not self._left:
            return None
        return self._at + min(self._left.values()) * len(self._left)


class SharedCompute:
    """:class:`ProcessorSharing` on the running loop: :meth:`run` returns when the work is done."""

    def __init__(self) -> None:
        self._jobs = ProcessorSharing()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, work_s: float) -> None:
        """Do ``work_s`` seconds of prefill work, sharing the engine with the others."""
        if work_s <= 0.0:
            return
        loop = asyncio.get_running_loop()
        job = next(self._ids)
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[job] = waiter
        self._finish(self._jobs.add(job, work_s, loop.time()))
        self._schedule(loop)
        try:
            await waiter
        finally:
            if self._waiters.pop(job, None) is not None:  # given up before its end
                self._finish(self._jobs.remove(job, loop.time()))
                self._schedule(loop)

    def _finish(self, done: list[int]) -> None:
        """Wake the requests whose prefill is done (every caller of ``advance`` passes its
        result here: a job it returns is gone from the bookkeeping)."""
        for job in done:
            waiter = self._waiters.pop(job, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        end = self._jobs.next_end()
        if end is not None:
            self._timer = loop.call_at(end, self._tick, loop, end)

    def _tick(self, loop: asyncio.AbstractEventLoop, end: float) -> None:
        # The timer may fire a little before ``end`` (uvloop's clock counts milliseconds):
        # the job it was set for ends now all the same.
        self._timer = None
        self._finish(self._jobs.advance(max(loop.time(), end)))
        self._schedule(loop)
