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
from collections.abc import Callable

_DONE_S = 1e-9  # work left below this is done (float rounding)


class ProcessorSharing:
    """Jobs each with work left (seconds of the engine alone) and a priority (lower runs
    first, as vLLM's ``priority``): the jobs of the best priority present progress at ``1/n``
    each, the others wait until none of a better priority is left."""

    def __init__(self) -> None:
        self._left: dict[int, float] = {}
        self._priority: dict[int, int] = {}
        self._begun: set[int] = set()  # jobs :meth:`begun` reported
        self._at = 0.0  # when the work left was last brought up to date

    def __len__(self) -> int:
        return len(self._left)

    def _running(self) -> list[int]:
        """The jobs that progress now: those of the best priority present."""
        best = min(self._priority.values())
        return [job for job, p in self._priority.items() if p == best]

    def advance(self, now: float) -> list[int]:
        """Bring the work left up to ``now``; the jobs done by then, removed. Each job of the
        class that runs ends when its share of the time covers its work; what is left of the
        time goes on among the others, or to the next class once the class is done."""
        left = self._left
        done: list[int] = []
        while left and now > self._at:
            running = self._running()
            first = min(left[job] for job in running)
            step = min(now - self._at, first * len(running))
            share = step / len(running)
            for job in running:
                left[job] -= share
                if left[job] <= _DONE_S:
                    done.append(job)
                    self._drop(job)
            self._at += step
            if step <= 0.0:
                break
        self._at = max(self._at, now)
        ended = [job for job, rest in left.items() if rest <= _DONE_S]
        for job in ended:
            self._drop(job)
        return done + ended

    def add(self, job: int, work_s: float, now: float, priority: int = 0) -> list[int]:
        """``job`` starts at ``now`` with ``work_s`` seconds of work at ``priority``; the jobs
        done by then (a timer that fires late), removed."""
        done = self.advance(now)
        self._left[job] = work_s
        self._priority[job] = priority
        return done

    def remove(self, job: int, now: float) -> list[int]:
        """``job`` leaves before its end (its request was given up); the others done by then,
        removed."""
        done = self.advance(now)
        if job in self._left:
            self._drop(job)
        return [other for other in done if other != job]

    def begun(self) -> list[int]:
        """The jobs that progress now and were not reported before (call after each
        :meth:`add`, :meth:`advance` and :meth:`remove`): a job of a worse priority begins
        once no better one is left, as an engine schedules it (a job done within the call that
        brought it up is not reported)."""
        if not self._left:
            return []
        new = [job for job in self._running() if job not in self._begun]
        self._begun.update(new)
        return new

    def _drop(self, job: int) -> None:
        del self._left[job]
        del self._priority[job]
        self._begun.discard(job)

    def next_end(self) -> float | None:
        """When the next job ends if none starts before (None: no job)."""
        if not self._left:
            return None
        running = self._running()
        return self._at + min(self._left[job] for job in running) * len(running)


class SharedCompute:
    """:class:`ProcessorSharing` on the running loop: :meth:`run` returns when the work is done."""

    def __init__(self) -> None:
        self._jobs = ProcessorSharing()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._on_begin: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, work_s: float, priority: int = 0,
                  begun: Callable[[], None] | None = None) -> None:
        """Do ``work_s`` seconds of prefill work, sharing the engine with the others of the
        lowest ``priority`` present (waiting while any of a lower one is in prefill).
        ``begun`` is called once the work begins to progress (at the latest when it is done)."""
        if work_s <= 0.0:
            if begun is not None:
                begun()
            return
        loop = asyncio.get_running_loop()
        job = next(self._ids)
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[job] = waiter
        if begun is not None:
            self._on_begin[job] = begun
        self._finish(self._jobs.add(job, work_s, loop.time(), priority))
        self._schedule(loop)
        try:
            await waiter
        finally:
            if self._waiters.pop(job, None) is not None:  # given up before its end
                self._finish(self._jobs.remove(job, loop.time()))
                self._schedule(loop)
            if (call := self._on_begin.pop(job, None)) is not None:
                call()  # done (or given up) within the call that would have begun it

    def _finish(self, done: list[int]) -> None:
        """Wake the requests whose prefill is done (every caller of ``advance`` passes its
        result here: a job it returns is gone from the bookkeeping), and tell those that began."""
        for job in self._jobs.begun():
            if (call := self._on_begin.pop(job, None)) is not None:
                call()
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
