"""Miss diagnosis: why a request reused less of a worker's cache than it could have.

A request *could* have reused the deepest prefix any worker was known to hold when it was routed
(the prefix index's best match, in the request's own namespace). When the worker it went to
reports fewer than half of those tokens as cached, the request missed, and the cause is the first
of these that applies:

``worker_restarted``
    the worker restarted since it cached the prefix (its start stamp changed, or its counters
    went back to zero between two health probes);
``diverted_by_load``
    another worker held a deeper match, and the policy sent the request elsewhere (load, or a
    hot prefix spread to a second holder);
``cold_placement``
    some worker held part of the prefix, too little to count as a match, so the request was
    placed as cold on a worker that held none of it; or the part held was a shared trunk the
    request branched off, and it was placed past the trunk (decision kind ``branch``);
``evicted_by_worker``
    the chosen worker was predicted to hold the prefix and served part of it, or the index
    models its cache as full: it evicted the rest under memory pressure;
``stale_index_entry``
    the chosen worker was predicted to hold the prefix, served none of it and is not short of
    room: the index entry was wrong (a flush, a request that never reached it, an assignment
    another replica published for a request that failed there);
``tenant_or_model_changed``
    nobody held the prefix in this namespace, but the same prompt text was sent recently for
    another tenant, model or cache salt (caches are never shared across namespaces).

Pure bookkeeping, no I/O: the proxy and the health loop feed it, ``/admin/misses``, the metrics
and the status page read it; a restart it sees is told once to its ``on_restart`` (the cache
lifecycle).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import xxhash

from gateway.values import value

CAUSES = (
    "worker_restarted",
    "diverted_by_load",
    "cold_placement",
    "evicted_by_worker",
    "stale_index_entry",
    "tenant_or_model_changed",
)
_RECENT = 200
_TEXTS = 10_000


def prompt_head_hash(text: str, chars: int) -> int:
    """A hash of the prompt's first ``chars`` characters, namespace-free (0 when shorter: a
    short prompt two tenants both send is no sign of a changed tenant)."""
    if len(text) < chars:
        return 0
    return xxhash.xxh3_64_intdigest(text[:chars].encode("utf-8")) or 1


@value
class Outcome:
    """What routing predicted and what the worker reported, for one request."""

    worker: str
    kind: str  # the decision kind (prefix_hit, cold, diverted, spread, ...)
    match_blocks: int  # blocks the index said the chosen worker held
    best_blocks: int  # the deepest match any worker had (no minimum)
    total_blocks: int  # blocks in the request's fingerprint
    input_tokens: int
    cached_tokens: int
    restarted: bool = False
    namespace_changed: bool = False
    worker_evicting: bool = False  # the index models the worker's cache as full

    def possible_tokens(self) -> int:
        """Prompt tokens the best known holder could have served from its cache."""
        if not self.total_blocks:
            return 0
        return round(self.input_tokens * min(self.best_blocks, self.total_blocks)
                     / self.total_blocks)

    def predicted_tokens(self) -> int:
        """Prompt tokens the index predicted the chosen worker to serve from its cache."""
        if not self.total_blocks:
            return 0
        return round(self.input_tokens * min(self.match_blocks, self.total_blocks)
                     / self.total_blocks)


def classify(o: Outcome) -> str | None:
    """The cause of a miss, or None when the request reused what it could."""
    possible = o.possible_tokens()
    if possible <= 0:
        return "tenant_or_model_changed" if o.namespace_changed else None
    if o.cached_tokens * 2 >= possible:
        return None
    if o.restarted:
        return "worker_restarted"
    if o.match_blocks < o.best_blocks:
        return "cold_placement" if o.kind == "branch" or (
            o.match_blocks == 0 and o.kind == "cold") else (
            "diverted_by_load")
    if o.cached_tokens > 0 or o.worker_evicting:
        return "evicted_by_worker"
    return "stale_index_entry"


@dataclass(frozen=True, slots=True)
class Miss:
    at: float  # epoch seconds
    request_id: str
    worker: str
    cause: str
    kind: str
    possible_tokens: int
    predicted_tokens: int
    cached_tokens: int
    input_tokens: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class MissTracker:
    """Recent misses, counts per worker and cause, and the facts classification needs."""

    def __init__(self, recent: int = _RECENT, texts: int = _TEXTS) -> None:
        self._recent: deque[Miss] = deque(maxlen=recent)
        self._counts: dict[tuple[str, str], int] = {}
        self._texts: OrderedDict[int, int] = OrderedDict()  # prompt head hash -> namespace
        self._text_limit = texts
        self._starts: dict[str, str] = {}  # worker -> start stamp it reported last
        self._queries: dict[str, float] = {}  # worker -> cache query counter at the last probe
        self._restarted_at: dict[str, float] = {}  # worker -> monotonic time a restart was seen
        self.requests = 0  # requests with a cache report
        # Told once of each restart, by whichever fact shows it first (the cache lifecycle:
        # the worker's index entries go, and it is warmed as a worker that joined).
        self.on_restart: Callable[[str], None] | None = None

    # -- facts ------------------------------------------------------------------------------
    def namespace_changed(self, text_hash: int, namespace: int) -> bool:
        """Whether this prompt head was last seen in another namespace; remembers this one."""
        if not text_hash:
            return False
        texts = self._texts
        previous = texts.get(text_hash)
        texts[text_hash] = namespace
        texts.move_to_end(text_hash)
        if len(texts) > self._text_limit:
            texts.popitem(last=False)
        return previous is not None and previous != namespace

    def worker_started(self, worker: str, stamp: str) -> bool:
        """Record the start stamp a worker reported; True if it changed (a restart)."""
        if not stamp:
            return False
        previous = self._starts.get(worker)
        self._starts[worker] = stamp
        if previous is not None and previous != stamp:
            self._queries.pop(worker, None)  # the next probe's counter is the new start's
            self._restarted(worker)
            return True
        return False

    def probed(self, worker: str, cache_queries: float | None) -> bool:
        """A health probe's cache query counter; True if it went backwards (a restart)."""
        if cache_queries is None:
            return False
        previous = self._queries.get(worker)
        self._queries[worker] = cache_queries
        if previous is not None and cache_queries < previous:
            self._starts.pop(worker, None)  # the next stamp reported is the new start's
            self._restarted(worker)
            return True
        return False

    def _restarted(self, worker: str) -> None:
        """A restart, seen by one of its two facts: the other one's baseline was dropped, so
        that the same restart is not seen twice."""
        self._restarted_at[worker] = time.monotonic()
        if self.on_restart is not None:
            self.on_restart(worker)

    def restarted_since(self, worker: str, since: float) -> bool:
        at = self._restarted_at.get(worker)
        return at is not None and at >= since

    # -- outcomes ---------------------------------------------------------------------------
    def observe(self, outcome: Outcome, request_id: str) -> str | None:
        """Classify one request; a miss is kept and counted. Returns its cause."""
        self.requests += 1
        cause = classify(outcome)
        if cause is None:
            return None
        key = (outcome.worker, cause)
        self._counts[key] = self._counts.get(key, 0) + 1
        self._recent.append(Miss(
            at=time.time(), request_id=request_id, worker=outcome.worker, cause=cause,
            kind=outcome.kind, possible_tokens=outcome.possible_tokens(),
            predicted_tokens=outcome.predicted_tokens(), cached_tokens=outcome.cached_tokens,
            input_tokens=outcome.input_tokens,
        ))
        return cause

    def recent(self, limit: int = _RECENT) -> list[Miss]:
        """The newest misses first."""
        out = list(self._recent)[-limit:] if limit > 0 else []
        out.reverse()
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        """worker -> cause -> misses."""
        out: dict[str, dict[str, int]] = {}
        for (worker, cause), n in sorted(self._counts.items()):
            out.setdefault(worker, {})[cause] = n
        return out
