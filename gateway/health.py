"""Health probes: every worker's health, models, versions and cache size, once at start-up and
then every ``health_interval_s``; a worker that fails its probe leaves the routing until it
passes one again.

A probe that timed out takes a healthy worker out at once when another probe of the same
round was answered in time. When every probe of a round timed out, it takes a worker out only
if its probe before timed out too: one stall of the gateway's own event loop (a long garbage
collection, a host starved of CPU) makes every probe of a round time out together, and must not
empty the pool while the workers are fine. A refused connection or an error answer takes a
worker out at once, and a worker that keeps answering requests while its probe timed out is
kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from gateway.backends.base import CACHE_CAPACITY_TOKENS, ENGINE_RANKS, WorkerProbe
from gateway.contracts import engine_metrics as metric
from gateway.lifecycle import CacheLifecycle
from gateway.misses import MissTracker
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

    async def _probe(self, worker: Worker) -> WorkerProbe:
        try:
            backend = self._state.backend_for(worker)
        except LookupError as exc:
            return WorkerProbe(False, frozenset(), str(exc))
        return await backend.probe(worker)

    async def probe_all(self) -> None:
        """Probe every worker once and update the pool with what each answered."""
        state = self._state
        workers = state.pool.states()
        # A probe that only timed out is no proof of a hang when the worker sent us replies or
        # stream chunks while it was waited for.
        alive_since = time.monotonic()
        probes = await asyncio.gather(*(self._probe(s.worker) for s in workers))
        self._timed_out &= {s.worker.id for s in workers}  # forget workers that left
        # Some probe came back in time: the gateway's loop ran, a timeout is the worker's.
        loop_ran = not all(probe.timed_out for probe in probes)
        for s, probe in zip(workers, probes, strict=True):
            try:
                self._take(s.worker, s.healthy, probe, alive_since, loop_ran)
            except Exception:  # one worker's odd answer must not cost the others their round
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
        if self._misses.probed(wid, queries):
            log.warning("worker %s restarted (its cache counters went back); its cache is "
                        "cold", wid)
            state.index.forget_worker(wid)
        if probe.healthy:
            state.pool.mark_up(wid, probe.models, probe.metrics)
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
            state.guard.ejections.eject(wid, probe.error)

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
        """Probe every ``health_interval_s``, or sooner when woken, until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._state.settings.health_interval_s)
            self._wake.clear()
            try:
                await self.probe_all()
            except Exception:
                log.exception("health check round failed")
