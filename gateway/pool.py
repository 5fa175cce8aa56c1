"""The gateway's live view of its workers: membership, health, load, and the ring.

Mutable state lives here (and in the prefix index), owned by one object per application; the
routing engine only ever sees an immutable :class:`Snapshot` built from it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.backends.registry import kind_of_url
from gateway.contracts.engine_metrics import (
    FIRST_TOKEN_TIME_COUNT,
    FIRST_TOKEN_TIME_SUM,
    QUEUE_TIME_COUNT,
    QUEUE_TIME_SUM,
    RUNNING,
    WAITING,
)
from gateway.kvevents.endpoints import EventEndpoints, data_parallel_size, split_url
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import PrefixMatcher, Snapshot, Worker, WorkerView, rank_suffix

log = logging.getLogger(__name__)

# Below this mean admission wait, requests waiting in an engine do not count as waiting.
QUEUE_FLOOR_S = 0.02

_COST_EWMA = 0.05  # weight of the newest request in a worker's mean request cost


def worker_id_for(url: str) -> str:
    """A stable, readable id for a worker URL (``host:port``; ``sm:endpoint/variant`` for
    ``sagemaker://`` targets): as its backend kind reads it."""
    return kind_of_url(url).worker_id(url)


@dataclass(slots=True)
class WorkerState:
    worker: Worker
    # "static" (--worker), "registry" (registered in the store) or "kubernetes" (a pod that
    # gateway.discovery found)
    source: str = "static"
    healthy: bool = False
    inflight_requests: int = 0
    inflight_tokens: int = 0
    inflight_prefill: int = 0  # predicted uncached prompt tokens of requests before 1st token
    copies: int = 0  # the volume guard's copies of sessions in flight there (gateway.prewarm)
    copies_yield: bool = False  # its engine runs those copies at background priority
    engine: str = ""  # its engine, as its model listing names itself ("" unknown)
    # ticket -> (checkpoint hashes, predicted cached prompt tokens) of each request in flight
    inflight_prompts: dict[int, tuple[Sequence[int], int]] = field(default_factory=dict)
    remote_tokens: int = 0  # in flight from other gateway replicas, as last read
    capacity_blocks: int = 0  # in the gateway's fingerprint blocks; 0 = unknown
    last_error: str = ""
    routed: int = 0
    input_tokens: int = 0
    matched_tokens: int = 0
    models: frozenset[str] = field(default_factory=frozenset)
    engine_metrics: Mapping[str, float] = field(default_factory=dict)  # scraped from /metrics
    scraped_at: float = 0.0  # when (monotonic clock) engine_metrics were scraped; 0: never
    own_at_scrape: int = 0  # requests this gateway had in flight there at that scrape
    # Requests its engine runs at once, learned from a scrape that showed requests waiting for
    # admission (the running count then is the engine's limit; vLLM's depends on what fits in
    # its KV cache, so a later scrape running more raises it); 0 = not seen full yet.
    slots: int = 0
    # Mean seconds the requests its engine admitted since the scrape before waited for
    # admission (vLLM's request_queue_time histogram); None: the engine does not say.
    queue_s: float | None = None
    queue_seen: tuple[float, float] = (0.0, 0.0)  # that histogram's sum and count, last scrape
    # Mean seconds to the first token of the requests its engine started since the scrape
    # before (vLLM's time_to_first_token histogram); None: the engine does not say.
    first_token_s: float | None = None
    first_token_seen: tuple[float, float] = (0.0, 0.0)
    events: EventEndpoints | None = None  # where its engine publishes KV events
    predictions: int = 0  # responses whose cached tokens the gateway had predicted
    predicted_exactly: int = 0  # ... and got exactly right
    # ... and predicted more cached tokens than the worker reused (the engine had evicted
    # what the index still modelled), or fewer; and by how many tokens in all.
    predicted_over: int = 0
    predicted_under: int = 0
    over_tokens: int = 0
    under_tokens: int = 0

    mean_cost_tokens: float = 0.0  # moving average of the cost of requests routed here
    # Warm-up (gateway.warmup): left out of routing while it warms, then its ring weight
    # ramps up by this factor.
    held_out: bool = False
    ramp: float = 1.0
    versions: dict[str, str] = field(default_factory=dict)  # model -> version it reported

    def waiting_requests(self) -> int:
        """Requests waiting for admission in its engine: what the engine reported at the last
        scrape, or, once the engine has been seen full, the requests this gateway has in
        flight there beyond its ``slots`` when that is more. The gateway's own count is current
        at every decision, where a scrape is seconds old (routing on a stale count alone sends
        every request of those seconds to the worker that looked idle); the scrape counts what
        other gateways and clients sent. 0 while the engine's recent requests waited less
        than ``QUEUE_FLOOR_S`` on average for admission: an engine that turns its queue over
        in milliseconds makes nobody wait as long as a prefill elsewhere would take."""
        if self.queue_s is not None and self.queue_s < QUEUE_FLOOR_S:
            return 0
        scraped = int(self.engine_metrics.get(WAITING, 0.0)) if self.engine_metrics else 0
        if self.slots:
            return max(scraped, self.inflight_requests - self.slots)
        return scraped

    def view(self) -> WorkerView:
        """The router's view: what this gateway has in flight there now, plus the load from
        elsewhere. That is what the other gateway replicas have in flight there (through the
        store), or what the engine itself reported beyond this gateway's own requests at the
        last scrape (vLLM's running + waiting requests, in tokens at this gateway's mean
        request cost), whichever is larger: the engine's count sees load that no replica
        shares with us (clients that bypass the gateway, other gateways on another store).
        Only the part beyond our own counts: a scrape is seconds old, and the requests of
        ours it saw have mostly finished since (counting them again until the next scrape
        made a worker that was busy when it was scraped look busy for seconds after)."""
        tokens = self.inflight_tokens + self.remote_tokens
        requests = self.inflight_requests
        engine = self.engine_metrics
        if engine:
            queued = engine.get(RUNNING, 0.0) + engine.get(WAITING, 0.0)
            elsewhere = max(0, int(queued) - self.own_at_scrape)
            requests += elsewhere
            tokens = max(tokens, self.inflight_tokens + int(elsewhere * self.mean_cost_tokens))
        worker = self.worker
        if self.ramp != 1.0:
            worker = dataclasses.replace(worker, weight=worker.weight * self.ramp)
        return WorkerView(worker, self.healthy and not self.held_out, requests, tokens,
                          self.inflight_prefill, tuple(self.inflight_prompts.values()),
                          self.waiting_requests(), self.first_token_s, self.copies,
                          self.copies_yield)


def _mean_since(metrics: Mapping[str, float], sum_name: str, count_name: str,
                seen: tuple[float, float]) -> tuple[tuple[float, float], bool, float | None]:
    """A histogram of the scrape (its ``sum_name`` and ``count_name`` samples; ``seen``: both
    at the scrape before): the pair to keep for the next scrape, whether it says something new,
    and what: the mean of the observations since, or None when its counters went back (the
    engine restarted). Not reported: nothing new, and ``seen`` kept."""
    total, count = metrics.get(sum_name), metrics.get(count_name)
    if total is None or count is None:
        return seen, False, None
    seen_total, seen_count = seen
    if count > seen_count and total >= seen_total:
        return (total, count), True, (total - seen_total) / (count - seen_count)
    return (total, count), count < seen_count or total < seen_total, None


def _note_engine_times(state: WorkerState, metrics: Mapping[str, float]) -> None:
    """The mean admission wait and time to first token of the requests the engine took since
    the last scrape. With none taken, the admission wait is 0 if none waits either, and both
    are otherwise unchanged."""
    reported = QUEUE_TIME_SUM in metrics and QUEUE_TIME_COUNT in metrics
    state.queue_seen, changed, mean = _mean_since(
        metrics, QUEUE_TIME_SUM, QUEUE_TIME_COUNT, state.queue_seen)
    if changed:
        state.queue_s = mean
    elif reported and not metrics.get(WAITING, 0.0):
        state.queue_s = 0.0
    state.first_token_seen, changed, mean = _mean_since(
        metrics, FIRST_TOKEN_TIME_SUM, FIRST_TOKEN_TIME_COUNT, state.first_token_seen)
    if changed:
        state.first_token_s = mean


class WorkerPool:
    def __init__(self, urls: Iterable[str], index: PrefixIndex, private_blocks: int = 0) -> None:
        self._workers: dict[str, WorkerState] = {}
        # An endpoint of data-parallel engine ranks (``#dp-size=N``) -> its ranks' worker ids.
        self._ranks: dict[str, tuple[str, ...]] = {}
        self._index = index
        # Blocks an engine keeps outside its prefix cache for the request it is admitting (the
        # prompt's partial last block, then its output): a worker of N blocks keeps at most
        # N - private_blocks cached ones while it admits a request, and that is what the
        # prefix index models. 1 with token-exact keys, whose blocks are the engine's own.
        self.private_blocks = private_blocks
        self._ring = Ring({})
        self._ring_dirty = False
        # Where a ring made stale by a change is rebuilt: given a callable, this schedules it
        # (the gateway passes its event loop's ``call_soon``, so that the rebuild, 1.3 ms at 16
        # workers and 5 ms at 64, runs between requests instead of inside one's decision);
        # None: at the next snapshot.
        self.defer: Callable[[Callable[[], None]], object] | None = None
        self._ring_due = False
        # Views for routing, refreshed only for the workers that changed since the last
        # snapshot, with pool-wide (in-flight tokens, weight) of the healthy ones kept alongside.
        self._views: dict[str, WorkerView] = {}
        self._stale: set[str] = set()
        self._tickets = 0
        self._healthy_tokens = 0
        self._healthy_weight = 0.0
        # The models the healthy workers serve and each one's namespace identity, read on every
        # request: computed once after any change of health, models or versions.
        self._catalog: tuple[frozenset[str], dict[str, str]] | None = None
        # Wraps the modelled index for routing (the engine-exact source, gateway.kvevents).
        self.matcher: Callable[[PrefixMatcher, float], PrefixMatcher] | None = None
        # Called with the worker id when a worker joins or leaves (gateway.warmup).
        self.on_join: Callable[[str], None] | None = None
        self.on_leave: Callable[[str], None] | None = None
        for url in urls:
            self.add(url)

    # -- membership ---------------------------------------------------------------------------
    def add(
        self,
        url: str,
        *,
        wid: str | None = None,
        weight: float = 1.0,
        source: str = "static",
        kind: str | None = None,
        events: EventEndpoints | None = None,
        dp_size: int | None = None,
    ) -> str:
        """Add a worker (no-op if known). A ``#kv-events=...&kv-replay=...`` fragment on
        ``url`` names where its engine publishes KV events (see gateway.kvevents.endpoints);
        ``#dp-size=N`` adds the N data-parallel ranks of the engine behind it instead, as
        workers ``<wid>/dp0`` ... ``<wid>/dp<N-1>`` (the endpoint's id stands for all of them
        in :meth:`remove`, :meth:`set_events`, :meth:`mark_up`, :meth:`set_weights`,
        :meth:`set_capacity` and ``in``). ``dp_size`` (a registered worker's) overrides the
        fragment's."""
        dp_size = dp_size or data_parallel_size(url)
        url, in_url = split_url(url)
        url = url.rstrip("/")
        events = events or in_url
        wid = wid or worker_id_for(url)
        if dp_size > 1 and not kind_of_url(url).data_parallel_ranks:
            raise ValueError(f"{url}: dp-size needs an http(s):// or vllm+http(s):// worker")
        if dp_size == 1:
            self._add_one(url, wid, weight, source, kind, events, None)
        elif wid not in self._ranks and wid not in self._workers:
            feeds = events.ranks(dp_size) if events else [None] * dp_size
            ranks = tuple(wid + rank_suffix(r) for r in range(dp_size))
            self._ranks[wid] = ranks
            for rank, rank_id in enumerate(ranks):
                self._add_one(url, rank_id, weight, source, kind, feeds[rank], rank)
        return wid

    def _add_one(self, url: str, wid: str, weight: float, source: str, kind: str | None,
                 events: EventEndpoints | None, rank: int | None) -> None:
        if wid in self._workers:
            return
        by_url = kind_of_url(url)
        worker = Worker(wid, by_url.target_url(url), weight=weight, kind=kind or by_url.name,
                        rank=rank)
        self._workers[wid] = WorkerState(worker, source=source, events=events)
        self._stale.add(wid)
        self._catalog = None
        self._rebuild_ring()
        log.info("worker %s joined (%s, %s)", wid, url, source)
        if self.on_join is not None:
            self.on_join(wid)

    def remove(self, wid: str) -> None:
        """Remove a worker; an endpoint's id removes all its ranks."""
        for rank_id in self._ranks.pop(wid, ()):
            self.remove(rank_id)
        state = self._workers.get(wid)
        if state is not None and state.worker.rank is not None:
            endpoint = state.worker.endpoint_id
            others = tuple(r for r in self._ranks.get(endpoint, ()) if r != wid)
            if others:
                self._ranks[endpoint] = others
            else:
                self._ranks.pop(endpoint, None)
        if self._workers.pop(wid, None) is not None:
            self._stale.add(wid)
            self._catalog = None
            self._index.forget_worker(wid)
            self._rebuild_ring()
            log.info("worker %s left", wid)
            if self.on_leave is not None:
                self.on_leave(wid)

    def set_events(self, wid: str, events: EventEndpoints | None) -> None:
        for rank, rank_id in enumerate(self._ranks.get(wid, ())):
            self.set_events(rank_id, events.for_rank(rank) if events else None)
        state = self._workers.get(wid)
        if state is not None:
            state.events = events

    def event_endpoints(self) -> dict[str, EventEndpoints]:
        return {wid: s.events for wid, s in self._workers.items() if s.events is not None}

    def healthy_ids(self) -> set[str]:
        return {wid for wid, s in self._workers.items() if s.healthy}

    def capacities(self) -> dict[str, int]:
        return {wid: s.capacity_blocks for wid, s in self._workers.items()}

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New ring weights (an endpoint's for each of its ranks); the ring is rebuilt once,
        and only if one changed."""
        changed = False
        for wid, weight in self._per_worker(weights).items():
            state = self._workers.get(wid)
            if state is not None and abs(state.worker.weight - weight) > 1e-9:
                state.worker = dataclasses.replace(state.worker, weight=weight)
                self._stale.add(wid)
                changed = True
        if changed:
            self._rebuild_ring()

    def _per_worker(self, values: Mapping[str, float]) -> dict[str, float]:
        """``values`` with each endpoint's value given to each of its ranks."""
        out: dict[str, float] = {}
        for wid, value in values.items():
            for member in self._ranks.get(wid, (wid,)):
                out[member] = value
        return out

    def set_held_out(self, wid: str, held_out: bool) -> None:
        """Leave a worker out of routing (it is warming up) or take it back in."""
        state = self._workers.get(wid)
        if state is not None and state.held_out != held_out:
            state.held_out = held_out
            self._stale.add(wid)

    def set_ramp(self, wid: str, factor: float) -> None:
        """Scale a worker's ring weight by ``factor`` (a joining worker's ramp to 1)."""
        state = self._workers.get(wid)
        if state is not None and abs(state.ramp - factor) > 1e-9:
            state.ramp = factor
            self._stale.add(wid)
            self._rebuild_ring()

    def set_capacity(self, wid: str, blocks: int) -> None:
        """``wid``'s cache holds ``blocks`` (its reported size, in the index's blocks; an
        endpoint's: each of its ranks')."""
        for rank_id in self._ranks.get(wid, ()):
            self.set_capacity(rank_id, blocks)
        state = self._workers.get(wid)
        if state is not None and blocks > 0 and blocks != state.capacity_blocks:
            state.capacity_blocks = blocks
            self._index.set_capacity(wid, max(1, blocks - self.private_blocks))

    def model_size(self, wid: str) -> int:
        """The cached blocks the prefix index models ``wid`` as keeping at most: its reported
        size less :attr:`private_blocks` (0: size unknown)."""
        state = self._workers.get(wid)
        if state is None or not state.capacity_blocks:
            return 0
        return max(1, state.capacity_blocks - self.private_blocks)

    def set_remote_load(self, load: Mapping[str, int]) -> None:
        for wid, state in self._workers.items():
            remote = load.get(wid, 0)
            if remote != state.remote_tokens:
                state.remote_tokens = remote
                self._stale.add(wid)

    def local_load(self) -> dict[str, int]:
        return {wid: s.inflight_tokens for wid, s in self._workers.items() if s.inflight_tokens}

    def _rebuild_ring(self) -> None:
        # Lazily: a burst of membership changes costs one rebuild, made where ``defer`` runs
        # it, or else at the next snapshot.
        self._ring_dirty = True
        if self.defer is not None and not self._ring_due:
            self._ring_due = True
            self.defer(self.prepare_ring)

    @property
    def ring_stale(self) -> bool:
        """Whether a change waits for its ring rebuild (``defer``'s, or the next snapshot's)."""
        return self._ring_dirty

    def prepare_ring(self) -> None:
        """Build the ring now if a change left it stale (else the next snapshot would)."""
        self._ring_due = False
        if self._ring_dirty:
            self._build_ring()

    def __contains__(self, wid: str) -> bool:
        return wid in self._workers or wid in self._ranks

    def states(self) -> list[WorkerState]:
        return list(self._workers.values())

    def get(self, wid: str) -> WorkerState:
        """``wid``'s state; for an endpoint of data-parallel ranks, its rank 0's."""
        ranks = self._ranks.get(wid)
        return self._workers[ranks[0] if ranks else wid]

    # -- health -------------------------------------------------------------------------------
    def mark_up(
        self, wid: str, models: frozenset[str], metrics: Mapping[str, float] | None = None,
        own: int | None = None, engine: str = "",
    ) -> None:
        """``wid`` answered its probe: it serves ``models``, its engine's ``metrics`` were
        just read (None: not read). ``own``: the requests of this gateway in flight there
        when they were read (None: as many as now; a replay of a logged scrape gives it).
        ``engine``: the engine, as its model listing names itself ("": not said)."""
        for rank_id in self._ranks.get(wid, ()):
            self.mark_up(rank_id, models, metrics, engine=engine)  # each rank's own count
        state = self._workers.get(wid)
        if state is None:
            return
        if engine:
            state.engine = engine
        self._stale.add(wid)
        self._catalog = None
        if metrics is not None:
            state.engine_metrics = dict(metrics)
            state.scraped_at = time.monotonic()
            state.own_at_scrape = state.inflight_requests if own is None else own
            _note_engine_times(state, metrics)
            running = int(metrics.get(RUNNING, 0.0))
            if metrics.get(WAITING, 0.0) > 0 and running >= 1:
                state.slots = running  # full: what it runs now is its limit now
            elif state.slots and running > state.slots:
                state.slots = running  # it runs more at once than it did when last full
        if not state.healthy:
            log.info("worker %s is up (models: %s)", wid, ", ".join(sorted(models)) or "?")
        state.healthy = True
        state.last_error = ""
        if models and models != state.worker.models:
            state.worker = dataclasses.replace(state.worker, models=models)

    def set_versions(self, wid: str, versions: Mapping[str, str]) -> list[str]:
        """Record the model versions a worker reports; returns the models whose version
        changed from one it reported before. Their cache is another model's now: whatever the
        index knew about the worker is dropped."""
        state = self._workers.get(wid)
        if state is None or not versions:
            return []
        changed = [m for m, v in versions.items() if state.versions.get(m, v) != v]
        state.versions = dict(versions)
        self._catalog = None
        if changed:
            log.warning("worker %s now serves another version of %s: forgetting its cache",
                        wid, ", ".join(sorted(changed)))
            self._index.forget_worker(wid)
        return changed

    def forget_index(self, wid: str) -> None:
        """Drop what the prefix index knows about ``wid`` (its cache was flushed)."""
        self._index.forget_worker(wid)

    def retain_index(self, wid: str, keep: Callable[[int], bool]) -> None:
        """The prefix index keeps of ``wid`` only the prefixes ``keep`` accepts (its cache was
        emptied; what was sent there since is being stored again)."""
        self._index.retain(wid, keep)

    def modelled_blocks(self, wid: str) -> int:
        """Blocks the prefix index models ``wid``'s cache as holding."""
        return self._index.held_blocks(wid)

    def index_checkpoints(self) -> int:
        """Checkpoints of prompts the prefix index knows some worker to hold."""
        return len(self._index)

    def model_holds(self, wid: str, block: int) -> bool:
        """Whether the prefix index says ``wid`` holds the prefix ``block`` names."""
        return self._index.holds(wid, block)

    def model_identity(self, model: str) -> str:
        """``model`` plus the version most of its healthy workers report (the newest-looking
        on a tie), for cache namespaces: prefixes keyed under one version never match requests
        keyed under another. Just ``model`` while no worker reports a version."""
        return self._served()[1].get(model, model)

    def _served(self) -> tuple[frozenset[str], dict[str, str]]:
        if self._catalog is not None:
            return self._catalog
        models: set[str] = set()
        counts: dict[str, dict[str, int]] = {}
        for state in self._workers.values():
            if not state.healthy:
                continue
            models |= state.worker.models
            for model, version in state.versions.items():
                if version:
                    per = counts.setdefault(model, {})
                    per[version] = per.get(version, 0) + 1
        identities = {
            model: f"{model}@{max(per.items(), key=lambda kv: (kv[1], kv[0]))[0]}"
            for model, per in counts.items()
        }
        self._catalog = (frozenset(models), identities)
        return self._catalog

    def mark_down(self, wid: str, reason: str) -> None:
        state = self._workers.get(wid)
        if state is None:
            return
        self._stale.add(wid)
        self._catalog = None
        if state.healthy:
            log.warning("worker %s is down: %s", wid, reason)
            # Whatever it held is unknown now; a restarted worker comes back with a cold cache.
            self._index.forget_worker(wid)
        state.healthy = False
        state.last_error = reason

    def models(self) -> frozenset[str]:
        """The models the healthy workers serve."""
        return self._served()[0]

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self._workers.values())

    # -- load ---------------------------------------------------------------------------------
    def acquire(self, wid: str, tokens: int, prefill: int = 0,
                prompt: tuple[Sequence[int], int] | None = None) -> int:
        """One more request in flight on ``wid``: ``tokens`` of load, ``prefill`` of them
        prompt tokens it is predicted to compute (not cached); ``prompt``: its checkpoint
        hashes and the prompt tokens it is predicted to find cached. Returns the ticket to
        release it with (0 without a ``prompt``)."""
        state = self._workers[wid]
        self._stale.add(wid)
        state.inflight_requests += 1
        state.inflight_tokens += tokens
        state.inflight_prefill += prefill
        ticket = 0
        if prompt is not None:
            self._tickets += 1
            ticket = self._tickets
            state.inflight_prompts[ticket] = prompt
        state.routed += 1
        alpha = 1.0 if state.routed == 1 else _COST_EWMA
        state.mean_cost_tokens += alpha * (tokens - state.mean_cost_tokens)
        return ticket

    def copying(self, wid: str, change: int) -> None:
        """A copy of a session starts (``change`` 1) or ends (-1) on ``wid``: the volume
        guard sends no other there meanwhile (``WorkerView.copies``)."""
        state = self._workers.get(wid)
        if state is not None:
            self._stale.add(wid)
            state.copies = max(0, state.copies + change)

    def set_copies_yield(self, wid: str, yields: bool) -> None:
        """Whether ``wid``'s engine runs the session copies at background priority (the
        warm-up manager's probe found it takes the priority they carry)."""
        state = self._workers.get(wid)
        if state is not None and state.copies_yield != yields:
            self._stale.add(wid)
            state.copies_yield = yields

    def release(self, wid: str, tokens: int, prefill: int = 0, ticket: int = 0) -> None:
        """The request is over; ``prefill``: its prompt tokens still counted as queued;
        ``ticket``: what :meth:`acquire` returned."""
        state = self._workers.get(wid)
        if state is not None:
            self._stale.add(wid)
            state.inflight_requests -= 1
            state.inflight_tokens -= tokens
            state.inflight_prefill -= prefill
            state.inflight_prompts.pop(ticket, None)

    def prefilled(self, wid: str, prefill: int) -> None:
        """A request in flight on ``wid`` sent its first token: its prefill is done."""
        state = self._workers.get(wid)
        if state is not None:
            self._stale.add(wid)
            state.inflight_prefill -= prefill

    def record_cache_stats(self, wid: str, input_tokens: int, matched_tokens: int) -> None:
        state = self._workers.get(wid)
        if state is not None:
            state.input_tokens += input_tokens
            state.matched_tokens += matched_tokens

    def record_prediction(self, wid: str, predicted_tokens: int, matched_tokens: int) -> None:
        state = self._workers.get(wid)
        if state is not None:
            state.predictions += 1
            error = predicted_tokens - matched_tokens
            if error > 0:
                state.predicted_over += 1
                state.over_tokens += error
            elif error < 0:
                state.predicted_under += 1
                state.under_tokens -= error
            else:
                state.predicted_exactly += 1

    # -- routing input ------------------------------------------------------------------------
    @property
    def ring(self) -> Ring:
        if self._ring_dirty:
            self._build_ring()
        return self._ring

    def _build_ring(self) -> None:
        self._ring = Ring({wid: s.worker.weight * s.ramp for wid, s in self._workers.items()})
        self._ring_dirty = False

    def _refresh_views(self) -> None:
        """Recompute the views (and the healthy totals) of the workers that changed."""
        for wid in self._stale:
            old = self._views.get(wid)
            if old is not None and old.healthy:
                self._healthy_tokens -= old.inflight_tokens
                self._healthy_weight -= old.worker.weight
            state = self._workers.get(wid)
            if state is None:
                self._views.pop(wid, None)
                continue
            new = self._views[wid] = state.view()  # in place: the order stays the pool's
            if new.healthy:
                self._healthy_tokens += new.inflight_tokens
                self._healthy_weight += new.worker.weight
        self._stale.clear()

    def snapshot(self, now: float) -> Snapshot:
        """What routing sees at time ``now`` (the prefix index read at that instant). Costs
        O(workers changed since the last snapshot) plus one copy of the views tuple (a C-level
        copy, not a Python loop over the fleet)."""
        self._refresh_views()
        index: PrefixMatcher = self._index.at(now)
        if self.matcher is not None:
            index = self.matcher(index, now)
        return Snapshot(
            workers=tuple(self._views.values()),
            index=index,
            ring=self.ring,
            by_id=self._views,
            pool_load=(self._healthy_tokens, self._healthy_weight),
        )
