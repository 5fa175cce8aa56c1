"""Value objects the routing engine works on. Frozen; no I/O anywhere in ``gateway.routing``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from gateway.fingerprint import PrefixKey
from gateway.values import value


@dataclass(frozen=True, slots=True)
class Worker:
    """A routing target. ``models`` empty means "not known yet": it may serve any model."""

    id: str
    url: str
    models: frozenset[str] = frozenset()
    weight: float = 1.0
    kind: str = "openai"  # which backend speaks to it (gateway.backends)
    # A data-parallel rank of the engine behind ``url`` (``#dp-size=N`` on a worker URL):
    # requests name it in ``X-data-parallel-rank``; None: the endpoint is one engine.
    rank: int | None = None

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def endpoint_id(self) -> str:
        """The id of the endpoint this worker is served at: its own, or, for a rank, the
        endpoint's that its ranks share (credentials are the endpoint's)."""
        return self.id if self.rank is None else self.id.removesuffix(rank_suffix(self.rank))


def rank_suffix(rank: int) -> str:
    """What a rank's worker id adds to its endpoint's: ``10.0.0.5:8000/dp1``."""
    return f"/dp{rank}"


@value
class WorkerView:
    """A worker as the router sees it at one instant: health and load."""

    worker: Worker
    healthy: bool = True
    inflight_requests: int = 0
    inflight_tokens: int = 0
    # Prompt tokens of the requests in flight that the worker must prefill (not cached, as
    # predicted when each was routed), until their first token: the queue a new prefill waits
    # behind.
    inflight_prefill: int = 0
    # The requests this gateway has in flight there: each one's checkpoint hashes
    # (``PrefixKey.blocks``) and the prompt tokens it was predicted to find cached.
    inflight_prompts: tuple[tuple[Sequence[int], int], ...] = ()
    # Requests the engine itself reports waiting for admission (vLLM's
    # ``num_requests_waiting`` at the last scrape): queueing that prefill tokens do not show,
    # e.g. an engine whose running slots are all taken by cached requests decoding.
    waiting_requests: int = 0
    # Mean seconds to the first token of the requests its engine started lately (vLLM's
    # ``time_to_first_token`` histogram between two scrapes); None: the engine does not say.
    first_token_s: float | None = None
    # Copies of sessions the volume guard is making there (gateway.prewarm): one at a time,
    # unless its engine runs them at background priority.
    copies: int = 0
    # Its engine runs the volume guard's copies at a background scheduling priority (the
    # gateway sends them with ``--copy-priority`` and the engine takes it): a copy there
    # prefills with the capacity the requests leave, however busy it is.
    copies_yield: bool = False
    id: str = field(init=False)  # = worker.id; a plain attribute, read on every decision

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", self.worker.id)


@value
class RouteRequest:
    """What routing needs to know about one request; never the prompt text itself."""

    key: PrefixKey
    model: str
    cost_tokens: int  # the load it adds: prompt tokens plus its decode budget
    prompt_tokens: int = 0  # estimated prompt tokens (what a cache miss has to prefill)
    # Tokens per key block when ``key`` holds token-exact block keys (gateway.kvevents);
    # 0 when it is a character fingerprint.
    block_tokens: int = 0


class PrefixMatcher(Protocol):
    """Read side of a prefix index."""

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading checkpoints of ``blocks`` (a ``PrefixKey.blocks``)
        it holds; ``PrefixKey.depth_at`` turns that into blocks."""
        ...

    def heat(self, block: int) -> float:
        """Recent requests (decayed) that shared the prefix ``block`` names."""
        ...

    def branched(self, block: int) -> bool:
        """Whether a recorded prompt went on past the prefix ``block`` names (some worker
        holds a checkpoint right below it)."""
        ...

    def branches_grow(self, block: int) -> bool:
        """Whether later prompts extended the prompts that went on from the prefix ``block``
        names at least as often as they reused them (true until either is seen)."""
        ...

    def extends(self, block: int, depth: int) -> bool:
        """Whether a prompt going on past the prefix ``block`` names to its next checkpoint at
        ``depth`` blocks extends the prompt that recorded it (a session's next turn), rather
        than sharing it from inside."""
        ...

    def recent_requests(self, worker_id: str) -> float:
        """Recent requests (decayed) recorded for ``worker_id``."""
        ...

    def pool_recent_requests(self) -> float:
        """Recent requests (decayed) recorded for all workers together."""
        ...

    def recent_blocks(self, worker_id: str) -> float:
        """Prompt blocks (cached or not) of the recent requests recorded for ``worker_id``,
        decayed as ``recent_requests``."""
        ...

    def pool_recent_blocks(self) -> float:
        """Prompt blocks of the recent requests recorded for all workers together."""
        ...

    def session_blocks(self, block: int) -> float:
        """Prompt blocks of the recent requests of the session (prompts extending each other)
        that recorded the prefix ``block`` names, decayed as ``recent_requests``."""
        ...

    def mean_new_blocks(self) -> float:
        """Blocks a recent request added to its worker's cache, on average."""
        ...

    def tail_age(self, worker_id: str) -> float:
        """Age of the worker's least recently used block once its cache is full, else inf."""
        ...

    def fill(self, worker_id: str) -> float:
        """Share of the worker's cache in use: 0 when empty, 1 once full."""
        ...


class RingOrder(Protocol):
    """Consistent-hash ring: worker ids in ring order starting at ``anchor``."""

    def walk(self, anchor: int) -> Iterator[str]: ...


@value
class Snapshot:
    """Everything a policy may look at for one decision."""

    workers: tuple[WorkerView, ...]
    index: PrefixMatcher
    ring: RingOrder
    # Optional, kept up to date by whoever builds snapshots for a large fleet: worker id ->
    # view, and (in-flight tokens, weight) summed over healthy workers. With them a policy
    # that narrows its candidates decides without a pass over every worker.
    by_id: Mapping[str, WorkerView] | None = None
    pool_load: tuple[int, float] | None = None


class DecisionKind(StrEnum):
    """Why a worker was chosen, as a closed set (metric label, simulator tally, header)."""

    PREFIX_HIT = "prefix_hit"  # it holds the deepest usable known prefix of the request
    COLD = "cold"  # no worker is known to hold the prefix: placed from the anchor's ring walk
    # A holder exists but was filtered out (its load bound, a failure) or lost its credit (the
    # volume guard).
    DIVERTED = "diverted"
    SPREAD = "spread"  # a prefix given to one more holder: waiting cost more than the prefill
    # The known prefix is a shared trunk and most of the prompt is new: placed as a cold
    # prefix from the ring position past the trunk.
    BRANCH = "branch"
    PLACED = "placed"  # a policy without a prefix index (ring, round robin, least load)
    # The request names state that one worker alone holds (a stored response it continues):
    # that worker, whatever its prefix; the policy only saw it as the one candidate.
    PINNED = "pinned"


@value
class Decision:
    """The outcome of routing one request, in structured fields; :attr:`reason` renders them
    for a human (``x-route-reason``) and nothing parses it back."""

    worker: WorkerView
    policy: str
    kind: DecisionKind
    match_blocks: int = 0  # leading blocks the chosen worker is known to hold
    # Leading blocks the deepest known holder of any depth holds (no policy minimum): what
    # the request could have reused at best, for telemetry.
    known_blocks: int = 0
    # How the picker chose among equals: "ring", "ring skip=2", "round_robin", ...
    placement: str = ""
    picker: str = ""  # the picker's name: the metric label of PLACED decisions
    # The deepest known holder when it was not chosen (DIVERTED, SPREAD), why, and its depth.
    holder: str = ""
    holder_blocks: int = 0
    diverted_by: str = ""  # a filter name, "outscored" or "failed"
    note: str = ""  # free text appended to the reason (experiments)
    scores: Mapping[str, float] = field(default_factory=dict)
    # The chosen worker's load bound in tokens (before this request), when the policy has one.
    load_bound: float | None = None
    # The volume guard kept a session on this worker until a copy of its prompt is made on
    # ``copy_to`` (the pre-warmer sends it; the session's next turn moves there).
    copy_to: str = ""
    worker_id: str = field(init=False, compare=False, repr=False)  # = worker.id, read often

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_id", self.worker.id)

    @property
    def label(self) -> str:
        """A low-cardinality label: the kind, or the picker for index-less policies."""
        # str() of a StrEnum member is its value, as a plain str, without the enum's
        # ``value`` descriptor (read several times per request).
        if self.kind is DecisionKind.PLACED:
            return self.picker or str(self.kind)
        return str(self.kind)

    @property
    def reason(self) -> str:
        """One line a human reads: ``prefix_hit depth=37``, ``cold -> ring``, ..."""
        match self.kind:
            case DecisionKind.PREFIX_HIT:
                text = f"prefix_hit depth={self.match_blocks}"
            case DecisionKind.COLD:
                text = f"cold -> {self.placement}"
            case DecisionKind.DIVERTED:
                text = (f"diverted: {self.holder} {self.diverted_by} "
                        f"(depth={self.holder_blocks}) -> {self.placement}")
            case DecisionKind.SPREAD:
                text = (f"spread: {self.holder} {self.diverted_by} "
                        f"(depth={self.holder_blocks}) -> {self.placement}")
            case DecisionKind.PINNED:
                text = f"pinned: {self.placement} depth={self.match_blocks}"
            case DecisionKind.BRANCH:
                text = (f"branch past depth={self.holder_blocks} -> {self.placement}"
                        f" depth={self.match_blocks}")
            case _:
                text = self.placement
        if self.copy_to:
            text = f"{text} (session copied to {self.copy_to})"
        return f"{text} {self.note}" if self.note else text


class NoCandidates(Exception):
    """Every worker was filtered out (none healthy, or none serves the model)."""
