"""Cache lifecycle: a worker that reports a new model version, or restarted, starts from an
empty cache.

The health probe reads each worker's model versions (``/v1/models``: revision, tokenizer hash;
vLLM's ``root``). When one changes, the pool has already dropped what the prefix index knew
about that worker (:meth:`gateway.pool.WorkerPool.set_versions`) and requests are keyed under
the new version (:meth:`~gateway.pool.WorkerPool.model_identity`), so no request is routed on
an entry of the old model. This module then invalidates the worker's own cache (the reference
worker's ``/admin/flush``, vLLM's ``/reset_prefix_cache``), drops any index entries recorded
in the meantime, and hands the worker to the warm-up (it is as cold as a worker that just
joined).

A worker that restarted (its start stamp changed, or its cache counters went back: see
:mod:`gateway.misses`) lost its cache with its process, and may run with other settings: the
index forgets what it held, and the warm-up takes it as a worker that joined (it asks its engine
again whether it takes a scheduling priority).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gateway.backends.base import Backend
from gateway.pool import WorkerPool
from gateway.routing.types import Worker
from gateway.warmup import WarmupManager

log = logging.getLogger(__name__)

_FLUSH_LEASE_S = 120.0  # longer than the other gateways take to notice the change


class CacheLifecycle:
    def __init__(
        self, pool: WorkerPool, backend_for: Callable[[Worker], Backend], warmup: WarmupManager
    ) -> None:
        self.pool = pool
        self._backend_for = backend_for
        self.warmup = warmup
        self.invalidations = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def version_changed(self, worker: Worker) -> None:
        task = asyncio.get_running_loop().create_task(
            self._invalidate(worker), name=f"invalidate-{worker.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def restarted(self, wid: str) -> None:
        """``wid`` restarted: its cache is cold, whatever the index recorded there."""
        if wid not in self.pool:
            return
        log.warning("worker %s restarted; its cache is cold", wid)
        self.pool.forget_index(wid)
        self.warmup.restarted(wid)

    async def _invalidate(self, worker: Worker) -> None:
        self.warmup.left(worker.id)  # a warm-up of the old model is worthless now
        self.pool.set_held_out(worker.id, True)
        versions = self.pool.get(worker.id).versions if worker.id in self.pool else {}
        epoch = ",".join(f"{m}={v}" for m, v in sorted(versions.items()))
        try:
            # Gateways sharing a store flush the worker once: a second flush would empty it
            # again after the first gateway's warm-up had begun.
            if await self.warmup.first(f"invalidate:{worker.id}:{epoch}", _FLUSH_LEASE_S):
                invalidate = getattr(self._backend_for(worker), "invalidate", None)
                outcome = (await invalidate(worker) if invalidate is not None
                           else "nothing to call")
                log.info("worker %s: cache invalidated after a model change (%s)", worker.id,
                         outcome)
                self.invalidations += 1
                if worker.id in self.pool:
                    self.pool.forget_index(worker.id)
        except LookupError as exc:
            log.warning("worker %s: cannot invalidate its cache: %s", worker.id, exc)
        finally:
            if worker.id in self.pool:
                self.pool.set_held_out(worker.id, False)
                self.warmup.joined(worker.id, reason="model version changed", epoch=epoch)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
