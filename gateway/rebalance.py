"""Telemetry-driven rebalancing: a background task that reads hit telemetry and acts.

One replica leads at a time (a lease in the store; the embedded store always leads). Each round
it compares the shared hit counters with the previous round's and decides:

* **misprediction**: the index said "held" and the worker answered "miss" for more than
  ``mispredict_ratio`` of a worker's responses in the round. The index overestimates what that
  worker keeps (it restarted or flushed unnoticed, or reports a cache larger than it has), so
  its modelled capacity shrinks, by the share that missed (at least ``1 - shrink_factor``, at
  most ``max_shrink``), dropping its least recently used entries. After ``grow_after_rounds``
  rounds in a row with no miss it grows back towards the registered size by ``grow_factor``
  per round: slowly, so a worker that really holds less stays near its real size instead of
  swinging back and missing again. A worker reporting twice its real size is so brought to
  its real size in a few rounds.
* **thrashing**: a worker's hit rate collapsed against the previous round (below
  ``collapse_ratio`` of it *and* by at least ``min_collapse_drop``, so the noise of a low hit
  rate does not count) while the index holds at least as many of its prefixes as before. It
  sheds its least valuable prefixes (least recently used) so they go cold and are re-placed by
  the ring walk on its successors.

Ring weights that follow capacity are not decided here: every replica derives them from the
registry the same way (:mod:`gateway.sync`), so they agree without coordination.

Actions are typed (:class:`ShrinkCapacity`, :class:`GrowCapacity`, :class:`Shed`), appended to
the store's action log as JSON with their reason, applied by every replica (each reads the log
and applies what it has not applied yet), and served at ``/admin/rebalance``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar, TypeAlias

from gateway.contracts.tasks import stop_if_cancelled
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.store.base import HitCounters, MetadataStore, StoreUnavailable

log = logging.getLogger(__name__)

ACTION_LOG_SIZE = 200


@dataclass(frozen=True, slots=True)
class ShrinkCapacity:
    """A worker's modelled capacity shrinks to ``blocks`` (its predicted hits missed)."""

    action: ClassVar[str] = "shrink_capacity"
    id: str
    at: float
    worker: str
    blocks: int
    reason: str


@dataclass(frozen=True, slots=True)
class GrowCapacity:
    """A worker's modelled capacity grows back to ``blocks`` (rounds without a miss)."""

    action: ClassVar[str] = "grow_capacity"
    id: str
    at: float
    worker: str
    blocks: int
    reason: str


@dataclass(frozen=True, slots=True)
class Shed:
    """A worker drops ``fraction`` of its least recently used prefixes (thrashing)."""

    action: ClassVar[str] = "shed"
    id: str
    at: float
    worker: str
    fraction: float
    reason: str


RebalanceAction: TypeAlias = ShrinkCapacity | GrowCapacity | Shed


def action_to_json(action: RebalanceAction) -> dict[str, object]:
    """The action as the store's log keeps it: its fields plus ``"action"`` (the kind)."""
    return {"action": action.action, **asdict(action)}


def action_from_json(data: Mapping[str, object]) -> RebalanceAction | None:
    """An action read from the log; ``None`` for a kind or shape this version does not know."""
    aid, wid, at = data.get("id"), data.get("worker"), data.get("at")
    if not isinstance(aid, str) or not aid or not isinstance(wid, str):
        return None
    when = float(at) if isinstance(at, int | float) else 0.0
    why = str(data.get("reason", ""))
    kind, blocks, fraction = data.get("action"), data.get("blocks"), data.get("fraction")
    if kind in (ShrinkCapacity.action, GrowCapacity.action) and isinstance(blocks, int):
        # Older replicas logged a grow as shrink_capacity: both set the capacity to ``blocks``.
        if kind == GrowCapacity.action:
            return GrowCapacity(aid, when, wid, blocks, why)
        return ShrinkCapacity(aid, when, wid, blocks, why)
    if kind == Shed.action and isinstance(fraction, int | float):
        return Shed(aid, when, wid, float(fraction), why)
    return None


@dataclass(frozen=True, slots=True)
class RebalanceOptions:
    interval_s: float = 5.0
    min_predictions: int = 20  # responses in a round before mispredictions count
    mispredict_ratio: float = 0.1  # share of a round's responses that missed a predicted hit
    shrink_factor: float = 0.8  # modelled capacity kept after a misprediction round, at most
    max_shrink: float = 0.5  # ... and at least this share of it
    collapse_ratio: float = 0.5  # hit rate below this fraction of the previous round's
    min_collapse_drop: float = 0.15  # ... and this much lower in absolute terms
    grow_after_rounds: int = 3  # rounds in a row without a miss before the capacity grows
    grow_factor: float = 1.05  # modelled capacity growth per round after that
    min_requests: int = 20
    shed_fraction: float = 0.25


@dataclass
class Rebalancer:
    store: MetadataStore
    pool: WorkerPool
    index: PrefixIndex
    origin: str
    options: RebalanceOptions = field(default_factory=RebalanceOptions)
    leading: bool = False
    rounds: int = 0
    _previous: dict[str, HitCounters] = field(default_factory=dict)
    _last_rate: dict[str, float] = field(default_factory=dict)
    _last_held: dict[str, int] = field(default_factory=dict)
    _clean_rounds: dict[str, int] = field(default_factory=dict)
    _applied: set[str] = field(default_factory=set)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.options.interval_s)
            try:
                await self.step()
            except StoreUnavailable:
                stop_if_cancelled()
                continue  # the sync loops log the outage once
            except Exception:
                log.exception("rebalance round failed")
            stop_if_cancelled()

    async def step(self) -> list[RebalanceAction]:
        """One round: decide (if leading), then apply every action not applied yet."""
        self.rounds += 1
        decided: list[RebalanceAction] = []
        self.leading = await self.store.try_lead(self.origin, ttl_s=3 * self.options.interval_s)
        if self.leading:
            telemetry = await self.store.read_telemetry()
            decided = self.decide(telemetry.workers)
            for action in decided:
                log.info("rebalance: %s %s: %s", action.action, action.worker, action.reason)
                await self.store.log_action(action_to_json(action), keep=ACTION_LOG_SIZE)
        log_now = await self.store.recent_actions(ACTION_LOG_SIZE)
        for entry in reversed(log_now):
            logged = action_from_json(entry)
            if logged is not None:
                self.apply(logged)
        # Remember only what the log still holds, so this set stays bounded.
        self._applied &= {str(a.get("id", "")) for a in log_now}
        return decided

    def decide(self, workers: Mapping[str, HitCounters]) -> list[RebalanceAction]:
        opts = self.options
        actions: list[RebalanceAction] = []
        now = time.time()
        for wid, total in workers.items():
            if wid not in self.pool:
                continue
            before = self._previous.get(wid, HitCounters())
            d_req = total.requests - before.requests
            d_in = total.input_tokens - before.input_tokens
            d_hit = total.matched_tokens - before.matched_tokens
            d_pred = total.predicted_tokens - before.predicted_tokens
            d_miss = total.mispredicted - before.mispredicted
            held = self.index.held_blocks(wid)
            rate = d_hit / d_in if d_in > 0 else 0.0
            seq = f"{self.origin}:{self.rounds}:{wid}"
            clean = d_pred > 0 and d_req >= opts.min_predictions and d_miss == 0
            self._clean_rounds[wid] = self._clean_rounds.get(wid, 0) + 1 if clean else 0
            if d_pred > 0 and d_req >= opts.min_predictions and d_miss / d_req > (
                opts.mispredict_ratio
            ):
                kept = max(opts.max_shrink, min(opts.shrink_factor, 1.0 - d_miss / d_req))
                keep = max(1, int(held * kept))
                actions.append(ShrinkCapacity(
                    id=seq + ":shrink", at=now, worker=wid, blocks=keep,
                    reason=f"{d_miss} of {d_req} responses missed a predicted hit; "
                           f"modelled capacity {held} -> {keep} blocks",
                ))
            elif (
                self._clean_rounds[wid] >= opts.grow_after_rounds
                and self.index.capacity(wid) < self.pool.model_size(wid)
            ):
                grown = min(self.pool.model_size(wid),
                            int(self.index.capacity(wid) * opts.grow_factor) + 1)
                actions.append(GrowCapacity(
                    id=seq + ":grow", at=now, worker=wid, blocks=grown,
                    reason=f"{d_req} responses, no missed prediction; modelled capacity "
                           f"back up to {grown} blocks",
                ))
            elif (
                d_req >= opts.min_requests
                and wid in self._last_rate
                and rate < opts.collapse_ratio * self._last_rate[wid]
                and rate < self._last_rate[wid] - opts.min_collapse_drop
                and held >= self._last_held.get(wid, 0) > 0
            ):
                actions.append(Shed(
                    id=seq + ":shed", at=now, worker=wid, fraction=opts.shed_fraction,
                    reason=f"hit rate fell {self._last_rate[wid]:.2f} -> {rate:.2f} while "
                           f"its prefixes grew to {held} blocks (thrashing)",
                ))
            if d_in > 0:
                self._last_rate[wid] = rate
            self._last_held[wid] = held
            self._previous[wid] = HitCounters(**total.as_dict())
        return actions

    def apply(self, action: RebalanceAction) -> None:
        if action.id in self._applied:
            return
        self._applied.add(action.id)
        if action.worker not in self.pool:
            return
        match action:
            case ShrinkCapacity() | GrowCapacity():
                self.index.set_capacity(action.worker, action.blocks)
            case Shed():
                self.index.shed(action.worker, action.fraction)
