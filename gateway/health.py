"""Health probes: every worker's health, models, versions and cache size, once at start-up and
then once every ``health_interval_s``; a worker that fails its probe leaves the routing until it
passes one again.

The periodic rounds are spread over the interval: the pool's endpoints are probed in turn,
evenly apart (the data-parallel ranks of one server together, so that it is asked once), each
probe applied as it is answered. A round probed all at once is a burst of work for the
gateway's one event loop (three requests and a metrics page to parse per endpoint): with 64
workers it held every request in flight for tens of milliseconds every round, which made the
replay's p99 latency. The start-up round, and a round woken by a worker that joined, probe
every worker at once (:meth:`HealthChecker.probe_all`); the spread rounds start an interval
after such a round. A registry worker whose entry is gone is probed out of its turn
(:meth:`HealthChecker.probe_soon`, at most once an interval): it leaves once a probe finds it
down, and waiting for its turn could take up to two intervals after a round at once.

A probe that timed out takes a healthy worker out at once when another probe was answered in
time while it waited. When none was, it takes a worker out only if its probe before timed out
too: one stall of the gateway's own event loop (a long garbage collection, a host starved of
CPU) makes every probe in flight time out together, and must not empty the pool while the
workers are fine. In an at-once round the second probe is the next round's; in a spread round
the endpoint is probed again at once. A refused connection or an error answer takes a worker
out at once, and a worker that keeps answering requests while its probe timed out is kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from gateway.backends.base import CACHE_CAPACITY_TOKENS, ENGINE_RANKS, WorkerProbe
from gateway.contracts import engine_metrics as metric
from gateway.lifecycle import CacheLifecycle
from gateway.misses import MissTracker
from gateway.pool import WorkerState
from gateway.routing.types import Worker
from gateway.state import GatewayState

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self, state: GatewayState, lifecycle: CacheLifecycle, misses: MissTracker
    ) -> None:
        self._state = state
        self._lifecycle = lifecycle
        self._misses = misses
        self._timed_out: set[str] = set()  # workers whose last probe timed out
        self._wake = asyncio.Event()  # set: probe now, not at the end of the interval
        self._told_ranks: set[str] = set()  # workers said to be servers of several engines
        # When a probe was last answered in time (monotonic): a probe that timed out after
        # that began is the worker's doing, not a stall of the gateway's loop.
        self._answered_at = -math.inf
        # The probes of a spread round still out, by endpoint (a slow one is not started
        # again by the next round: its answer is applied once).
        self._probing: dict[tuple[str, str], asyncio.Task[None]] = {}
        # When each endpoint's last probe began (monotonic), for :meth:`probe_soon`.
        self._probed_at: dict[tuple[str, str], float] = {}

    async def _probe(self, worker: Worker) -> WorkerProbe:
        try:
            backend = self._state.backend_for(worker)
        except LookupError as exc:
            return WorkerProbe(False, frozenset(), str(exc))
        return await backend.probe(worker)

    async def probe_all(self) -> None:
        """Probe every worker at once and update the pool with what each answered."""
        state = self._state
        workers = state.pool.states()
        # A probe that only timed out is no proof of a hang when the worker sent us replies or
        # stream chunks while it was waited for.
        alive_since = time.monotonic()
        self._probed_at = {_endpoint(s.worker): alive_since for s in workers}
        probes = await asyncio.gather(*(self._probe(s.worker) for s in workers))
        self._timed_out &= {s.worker.id for s in workers}  # forget workers that left
        # Some probe came back in time: the gateway's loop ran, a timeout is the worker's.
        loop_ran = not all(probe.timed_out for probe in probes)
        if loop_ran:
            self._answered_at = time.monotonic()
        for s, probe in zip(workers, probes, strict=True):
            self._apply(s, probe, alive_since, loop_ran)

    async def spread_round(self, over_s: float) -> bool:
        """One round of probes spread evenly over ``over_s`` seconds: each endpoint of the pool
        (the ranks of one server together) after its share of the interval, in the order of
        their ids, each applied as it is answered. Returns True as soon as :meth:`wake` was
        called (the rest of the round is not probed), else False at the round's end; probes
        still out then go on (and an endpoint's is not started again while it is)."""
        state = self._state
        states = state.pool.states()
        self._timed_out &= {s.worker.id for s in states}  # forget workers that left
        endpoints: dict[tuple[str, str], list[WorkerState]] = {}
        for s in states:
            endpoints.setdefault(_endpoint(s.worker), []).append(s)
        self._probed_at = {key: at for key, at in self._probed_at.items() if key in endpoints}
        if not endpoints:  # nothing to probe: the interval, or a wake-up
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), over_s)
            return self._wake.is_set()
        step = over_s / len(endpoints)
        for key in sorted(endpoints):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), step)
            if self._wake.is_set():
                return True
            if key not in self._probing:
                self._start_probe(key, endpoints[key])
        return False

    def probe_soon(self, wid: str) -> None:
        """Probe the endpoint of ``wid`` now, out of its turn (its registry entry is gone: it
        leaves once a probe finds it down), unless it was probed within the last interval or
        is being probed."""
        pool = self._state.pool
        if wid not in pool:
            return
        key = _endpoint(pool.get(wid).worker)
        last = self._probed_at.get(key, -math.inf)
        if (key in self._probing
                or time.monotonic() - last < self._state.settings.health_interval_s):
            return
        self._start_probe(key, [s for s in pool.states() if _endpoint(s.worker) == key])

    async def answered(self) -> None:
        """Until every probe of the spread rounds still out has been answered (or has timed
        out) and applied."""
        while pending := [task for task in self._probing.values() if not task.done()]:
            await asyncio.wait(pending)

    def _start_probe(self, key: tuple[str, str], ranks: list[WorkerState]) -> None:
        """The probe of one endpoint, as a task of its own (kept until it ends)."""
        task = asyncio.create_task(self._probe_endpoint(ranks),
                                   name=f"gateway-health-probe-{key[1]}")
        self._probing[key] = task

        def ended(_: asyncio.Task[None]) -> None:
            if self._probing.get(key) is task:
                del self._probing[key]

        task.add_done_callback(ended)

    async def _probe_endpoint(self, ranks: list[WorkerState]) -> None:
        """Probe the workers of one endpoint (one, or the ranks of one server) and apply what
        each answered, as long as it is still in the pool. A probe that timed out while no
        other probe was answered may be the gateway's own stall: a healthy worker whose probe
        before was answered is kept, and probed again at once; a second timeout in a row takes
        it out (a stall has passed by then, and the probe is answered)."""
        pool = self._state.pool
        for _ in range(2):
            alive_since = time.monotonic()
            self._probed_at[_endpoint(ranks[0].worker)] = alive_since
            probes = await asyncio.gather(*(self._probe(s.worker) for s in ranks))
            in_time = not all(probe.timed_out for probe in probes)
            # Another probe answered in time while this one waited: the gateway's loop ran.
            loop_ran = in_time or self._answered_at > alive_since
            if in_time:
                self._answered_at = time.monotonic()
            doubted = False
            for s, probe in zip(ranks, probes, strict=True):
                wid = s.worker.id
                if wid not in pool:  # it left while it was probed
                    continue
                doubted |= (probe.timed_out and not loop_ran and s.healthy
                            and wid not in self._timed_out)
                self._apply(s, probe, alive_since, loop_ran)
            if not doubted:
                return

    def _apply(self, s: WorkerState, probe: WorkerProbe, alive_since: float,
               loop_ran: bool) -> None:
        """:meth:`_take`, for one worker of a round: one worker's odd answer must not cost the
        others their round."""
        try:
            self._take(s.worker, s.healthy, probe, alive_since, loop_ran)
        except Exception:
            log.exception("health of worker %s: its probe's answer could not be applied",
                          s.worker.id)

    def _take(self, worker: Worker, healthy: bool, probe: WorkerProbe, alive_since: float,
              loop_ran: bool) -> None:
        """Update the pool with what ``worker`` (``healthy`` before this round) answered."""
        state = self._state
        wid = worker.id
        timed_out_before = wid in self._timed_out
        if probe.timed_out:
            self._timed_out.add(wid)
        else:
            self._timed_out.discard(wid)
        queries = probe.metrics.get(metric.total(metric.PREFIX_CACHE_QUERIES))
        # Its counters back to zero: a restart, which the tracker tells the cache lifecycle.
        self._misses.probed(wid, queries)
        if probe.healthy:
            state.pool.mark_up(wid, probe.models, probe.metrics, engine=probe.engine)
            if state.pool.set_versions(wid, probe.versions):
                self._lifecycle.version_changed(worker)
            self._note_ranks(worker, probe)
            capacity = probe.metrics.get(CACHE_CAPACITY_TOKENS, 0.0)
            if capacity > 0:  # the index models the worker's cache at its real size
                blocks = max(1, int(capacity / state.settings.tokens_per_block()))
                state.pool.set_capacity(wid, blocks)
        elif probe.timed_out and state.guard.liveness.heard_since(wid, alive_since):
            log.info("worker %s: health probe timed out, but it keeps answering requests; "
                     "kept in the pool", wid)
        elif probe.timed_out and not timed_out_before and healthy and not loop_ran:
            log.info("worker %s: every probe of the round timed out (the gateway stalled?); "
                     "out if its next one does too", wid)
        else:
            state.pool.mark_down(wid, probe.error)
            # Requests waiting on it for a first byte go elsewhere now.
            state.guard.waits.eject(wid, probe.error)

    def _note_ranks(self, worker: Worker, probe: WorkerProbe) -> None:
        """Say once that a worker listed whole is a server of several data-parallel engines:
        its own balancer scatters prefixes over their caches."""
        ranks = int(probe.metrics.get(ENGINE_RANKS, 0))
        if ranks > 1 and worker.rank is None and worker.id not in self._told_ranks:
            self._told_ranks.add(worker.id)
            log.warning("worker %s serves %d data-parallel engines behind one port, routed to as "
                        "one worker: add '#dp-size=%d' to its URL for cache affinity per engine",
                        worker.id, ranks, ranks)

    def wake(self, _: str = "") -> None:
        """Start the next round now (a worker joined: it takes requests once a probe passed,
        and need not wait out the interval). Calls made before that round starts make one."""
        self._wake.set()

    async def run(self) -> None:
        """Rounds of probes until cancelled: after a round at once (the start-up round, or
        one woken by :meth:`wake`: :meth:`probe_all`), an interval's wait, then rounds spread
        over ``health_interval_s`` (:meth:`spread_round`) until woken again."""
        settings = self._state.settings
        try:
            while True:
                with contextlib.suppress(TimeoutError):  # every worker was just probed
                    await asyncio.wait_for(self._wake.wait(), settings.health_interval_s)
                while not self._wake.is_set():
                    try:
                        await self.spread_round(settings.health_interval_s)
                    except Exception:
                        log.exception("health check round failed")
                        await asyncio.sleep(settings.health_interval_s)
                self._wake.clear()
                try:
                    await self.probe_all()
                except Exception:
                    log.exception("health check round failed")
        finally:
            for task in list(self._probing.values()):
                task.cancel()


def _endpoint(worker: Worker) -> tuple[str, str]:
    """The endpoint a worker is served at: its ranks share one (and one probe)."""
    return worker.url, worker.endpoint_id
