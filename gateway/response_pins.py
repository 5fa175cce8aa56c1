"""Where each stored response lives, so that what refers to it reaches that worker.

An engine that stores Responses API answers (vLLM with its response store on, the reference
worker) keeps each in its own memory: a next turn by ``previous_response_id`` and
``GET /v1/responses/{id}`` work only on the server that answered. Routed by prefix, a next
turn that carries only its new input would land anywhere and be told the response does not
exist. So the gateway pins every response id it relays to the worker that produced it, and a
request that names a stored response goes to that worker and no other (a retry elsewhere could
only fail).

Pins live in the metadata store, so every process and replica of the gateway finds them:
routing metadata only, a keyed hash of tenant and response id bound to a worker id, never the
response itself; they lapse after ``--response-pin-ttl-s`` (0: no pins, for engines that share
their store, where any worker can answer such a request). They are per tenant: an id that
another tenant's request produced is not found, so tenants cannot read or continue each
other's conversations through the gateway even though the engine does not tell them apart.
Once made, a pin never changes (an id is one response on one worker), so each process also
keeps the pins it made or read recently and asks the store only for the others.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from gateway.auth import TenantHasher
from gateway.errors import InvalidRequest, NotFound, NoWorkerAvailable
from gateway.pool import WorkerPool
from gateway.store.base import MetadataStore, StoreUnavailable

log = logging.getLogger(__name__)

_KEPT = 10_000  # pins each process keeps at hand
_WARN_EVERY_S = 10.0  # while the store is away, one warning in this many seconds


class ResponsePins:
    def __init__(self, store: MetadataStore, hasher: TenantHasher, ttl_s: float) -> None:
        self._store = store
        self._hasher = hasher
        self.ttl_s = ttl_s
        self.enabled = ttl_s > 0  # 0: no pins (the engines share their store)
        self._kept: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._warned_at = -_WARN_EVERY_S

    async def remember(self, tenant_id: str, response_id: str, worker_id: str) -> None:
        """Pin ``response_id`` (of ``tenant_id``) to ``worker_id``. Without the store, the pin
        holds in this process only, and a warning says so."""
        name = self._hasher.pin_name(tenant_id, response_id)
        self._keep(name, worker_id, time.monotonic() + self.ttl_s)
        try:
            await self._store.pin(name, worker_id, self.ttl_s)
        except StoreUnavailable as exc:
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning("stored responses are pinned in this process only while the "
                            "store is away: %s", exc)

    async def home(self, tenant_id: str, response_id: str) -> str | None:
        """The worker that holds ``response_id`` for ``tenant_id``, or None; raises
        :class:`StoreUnavailable` when only the store could say."""
        name = self._hasher.pin_name(tenant_id, response_id)
        now = time.monotonic()
        kept = self._kept.get(name)
        if kept is not None and kept[1] > now:
            self._kept.move_to_end(name)
            return kept[0]
        worker_id = await self._store.pinned(name)
        if worker_id is not None:
            self._keep(name, worker_id, now + self.ttl_s)
        return worker_id

    async def home_in(self, pool: WorkerPool, tenant_id: str, response_id: str) -> str:
        """The worker of ``pool`` that holds ``response_id`` for ``tenant_id``; raises
        :class:`NotFound` for an id with no pin (or whose worker left the pool) and
        :class:`NoWorkerAvailable` while the store that would know is unreachable."""
        try:
            home = await self.home(tenant_id, response_id)
        except StoreUnavailable:
            raise NoWorkerAvailable("the metadata store, which says where stored responses "
                                    "are, is unreachable; retry shortly") from None
        shown = repr(response_id[:100])
        if home is None:
            raise NotFound(f"no stored response with id {shown}: ids are known to the gateway "
                           "that relayed them, for its --response-pin-ttl-s",
                           code="response_not_found")
        if home not in pool:
            raise NotFound(f"the response {shown} was stored by a worker that has left the "
                           "pool", code="response_not_found")
        return home

    async def continued_on(self, pool: WorkerPool, tenant_id: str, previous: str) -> str:
        """The worker a next turn by ``previous_response_id`` must go to (a 400 naming the
        parameter when there is none)."""
        try:
            return await self.home_in(pool, tenant_id, previous)
        except NotFound as exc:
            raise InvalidRequest(exc.message, param="previous_response_id",
                                 code="previous_response_not_found") from None

    async def forget(self, tenant_id: str, response_id: str) -> None:
        name = self._hasher.pin_name(tenant_id, response_id)
        self._kept.pop(name, None)
        try:
            await self._store.unpin(name)
        except StoreUnavailable as exc:
            log.warning("a deleted response's pin stays in the store until it lapses: %s", exc)

    def _keep(self, name: str, worker_id: str, until: float) -> None:
        self._kept[name] = (worker_id, until)
        self._kept.move_to_end(name)
        while len(self._kept) > _KEPT:
            self._kept.popitem(last=False)
