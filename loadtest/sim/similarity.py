"""Evaluation of a MinHash-LSH content-similarity hint (an idea from the field; issue 6).

The idea: prompts whose *content* overlaps but whose *prefixes* differ (RAG chunks in another
order) should go to the same worker. The hint keeps a MinHash sketch (``datasketch``) of each
recently routed prompt's content in an LSH index, with the worker it went to; for a new request
it finds the recent prompts with estimated Jaccard similarity >= ``threshold`` and scores each
candidate worker by the best similarity it served.

It is wired as one more scorer on top of a gateway policy (``cache_aware`` by default), so it
acts within that policy's filters (the same load guard) and picker. Two modes:

* ``cold`` (the proposal): only when no candidate holds ``min_match_blocks`` of the prefix
  (the request is cold), steer it to the most similar recent worker instead of the ring.
* ``tiebreak``: also among the workers that tie on the deepest known prefix (e.g. every holder
  of a tenant's system prompt), prefer the one that served the most similar content. It never
  moves a request away from a deeper match.

A worker's KV cache only reuses an exact prefix (:class:`worker.kvcache.PrefixCache`, like vLLM),
so content in another order is not a hit by itself; the simulator measures whether the hint
helps at all (BENCHMARKS.md, "MinHash-LSH similarity hint"; ``python -m
loadtest.sim.similarity``). Verdict: not a gateway scorer. With a tenant system prompt no request
is cold, so the hint never acts (and as a tie-break it moves the hit rate by +0.0003); with the
chunks first it adds +0.0017 (0.9 % relative, cache_aware is already at 0.99 of the pooled
bound); the one large gain (+0.020, one-block chunks) comes from the prefix index ignoring
one-block matches, and ``min_match_blocks=1`` gets more (+0.034) with no hint. It costs
~150 us per decision (3-4x cache_aware) plus numpy and scipy. This module stays as the evaluation.

``datasketch`` is imported lazily (:func:`load_datasketch`): it is not a project dependency.
In the simulator a prompt's content is its unchained content block ids
(:class:`loadtest.rag_trace.RagTrace`); a gateway would shingle the canonical text instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import xxhash

from gateway.fingerprint import PrefixKey
from gateway.routing.engine import Context, Profile, RoutingEngine
from gateway.routing.policies import PolicyOptions, build_engine
from gateway.routing.types import Decision, RouteRequest, Snapshot, WorkerView
from loadtest.rag_trace import RagSpec, rag_shape, rag_trace
from loadtest.sim.cluster import ClusterSim, SimConfig, SimResult, pooled_bound, simulate
from loadtest.sim.report import Metrics, metrics
from loadtest.traces import TraceRequest

Mode = Literal["cold", "tiebreak"]
MODES: tuple[Mode, ...] = ("cold", "tiebreak")

ContentOf = Callable[[RouteRequest], Sequence[int]]


class SimilarityUnavailable(RuntimeError):
    """``datasketch`` is not installed."""


def load_datasketch() -> ModuleType:
    """The ``datasketch`` module, imported on first use (it is not a project dependency)."""
    try:
        return importlib.import_module("datasketch")
    except ImportError as exc:
        raise SimilarityUnavailable(
            "the similarity hint needs datasketch: pip install datasketch"
        ) from exc


def _hash32(item: int) -> int:
    """MinHash input hash of one shingle (datasketch's affine32 scheme wants 32 bits)."""
    return xxhash.xxh32_intdigest(item.to_bytes(8, "little", signed=True))


@dataclass(frozen=True, slots=True)
class SimilarityOptions:
    mode: Mode = "cold"
    threshold: float = 0.5  # LSH threshold and the least similarity that counts
    num_perm: int = 64
    capacity: int = 4096  # recent (content, worker) entries kept
    max_candidates: int = 32  # most recent LSH candidates compared per query
    weight: float = 1.0  # cold: any similar worker beats the ring; tiebreak: see below
    seed: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown similarity mode {self.mode!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if self.num_perm < 2 or self.capacity < 1 or self.max_candidates < 1:
            raise ValueError("num_perm >= 2, capacity >= 1 and max_candidates >= 1 are required")
        if self.weight <= 0.0:
            raise ValueError("weight must be > 0")


class SimilarityIndex:
    """Recent prompts' MinHash sketches in an LSH index, each with the worker that served it.

    Bounded: at most ``capacity`` distinct (content, worker) entries, oldest dropped first; a
    repeat of an entry only refreshes it.
    """

    def __init__(self, opts: SimilarityOptions = SimilarityOptions()) -> None:
        self.opts = opts
        ds = load_datasketch()
        self._minhash: Any = ds.MinHash
        template = ds.MinHash(num_perm=opts.num_perm, seed=opts.seed, hashfunc=_hash32)
        self._permutations: Any = template.permutations
        self._lsh: Any = ds.MinHashLSH(threshold=opts.threshold, num_perm=opts.num_perm)
        # LSH key (increasing int) -> (worker id, sketch); dedup: (content digest, worker) -> key
        self._entries: OrderedDict[int, tuple[str, Any]] = OrderedDict()
        self._by_content: dict[tuple[int, str], int] = {}
        self._digest_of: dict[int, tuple[int, str]] = {}
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def sketch(self, content: Sequence[int]) -> Any:
        """The MinHash of the set of ``content`` shingles."""
        m = self._minhash(num_perm=self.opts.num_perm, hashfunc=_hash32,
                          permutations=self._permutations, scheme="affine32")
        m.update_batch(set(content))
        return m

    def query(self, sketch: Any) -> dict[str, float]:
        """Worker id -> best estimated similarity (>= threshold) of the content it served."""
        keys: list[int] = self._lsh.query(sketch)
        keys.sort(reverse=True)
        best: dict[str, float] = {}
        for key in keys[: self.opts.max_candidates]:
            wid, other = self._entries[key]
            j = float(sketch.jaccard(other))
            if j >= self.opts.threshold and j > best.get(wid, 0.0):
                best[wid] = j
        return best

    def record(self, content: Sequence[int], sketch: Any, worker_id: str) -> None:
        ident = (xxhash.xxh3_64_intdigest(repr(sorted(set(content))).encode()), worker_id)
        old = self._by_content.pop(ident, None)
        if old is not None:
            del self._digest_of[old]
            del self._entries[old]
            self._lsh.remove(old)
        key = self._next_key
        self._next_key += 1
        self._lsh.insert(key, sketch, check_duplication=False)
        self._entries[key] = (worker_id, sketch)
        self._by_content[ident] = key
        self._digest_of[key] = ident
        while len(self._entries) > self.opts.capacity:
            stale, _ = self._entries.popitem(last=False)
            self._lsh.remove(stale)
            del self._by_content[self._digest_of.pop(stale)]


class SimilarityScorer:
    """Scorer (``gateway.routing.engine.Scorer``): best similarity of the content each candidate
    recently served, in [0, 1], where the mode lets the hint act (see the module docstring)."""

    name = "similarity"

    def __init__(self, index: SimilarityIndex, content_of: ContentOf) -> None:
        self.index = index
        self.content_of = content_of
        self._pending: tuple[PrefixKey, Any] | None = None
        self.last: dict[str, float] = {}

    def sketch_for(self, request: RouteRequest) -> Any:
        """The request's sketch, computed once per decision (the router records it after)."""
        if self._pending is None or self._pending[0] is not request.key:
            self._pending = (request.key, self.index.sketch(self.content_of(request)))
        return self._pending[1]

    def score(self, ctx: Context, candidates: Sequence[WorkerView]) -> dict[str, float]:
        self.last = {}
        scores = {w.id: 0.0 for w in candidates}
        if ctx.matches:
            if self.index.opts.mode == "cold":
                return scores
            deepest = max(ctx.matches.get(w.id, 0) for w in candidates)
            eligible = {w.id for w in candidates if ctx.matches.get(w.id, 0) == deepest}
            if len(eligible) < 2:
                return scores
        else:
            eligible = set(scores)
        sims = self.index.query(self.sketch_for(ctx.request))
        for wid in eligible:
            scores[wid] = sims.get(wid, 0.0)
        self.last = {wid: s for wid, s in scores.items() if s > 0.0}
        return scores


class SimilarityRouter:
    """A gateway policy's engine plus the similarity scorer (simulator ``Router``).

    ``tiebreak`` weight: ``cache_cost`` scores equal-depth holders within ``queue_weight`` of
    each other, so a small weight (the default 1.0 is scaled by 0.1 there) reorders only them.
    """

    def __init__(self, policy: str, content_of: ContentOf,
                 policy_options: PolicyOptions | None = None,
                 opts: SimilarityOptions = SimilarityOptions()) -> None:
        base = build_engine(policy, policy_options or PolicyOptions())
        self.content_of = content_of
        self.index = SimilarityIndex(opts)
        self.scorer = SimilarityScorer(self.index, content_of)
        weight = opts.weight * (0.1 if opts.mode == "tiebreak" else 1.0)
        profile: Profile = dataclasses.replace(
            base.profile,
            name=f"{base.name}+similarity({opts.mode})",
            scorers=(*base.profile.scorers, (self.scorer, weight)),
        )
        self.engine = RoutingEngine(profile)
        self.steered = 0  # decisions where the chosen worker had a similarity score

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def uses_prefix_index(self) -> bool:
        return self.engine.uses_prefix_index

    def route(
        self, request: RouteRequest, snapshot: Snapshot, exclude: frozenset[str] = frozenset()
    ) -> Decision:
        sketch = self.scorer.sketch_for(request)
        decision = self.engine.route(request, snapshot, exclude)
        similarity = self.scorer.last.get(decision.worker_id)
        if similarity is not None:
            self.steered += 1
            decision = dataclasses.replace(decision, note=f"similar={similarity:.2f}")
        self.index.record(self.content_of(request), sketch, decision.worker_id)
        return decision


def content_lookup(content: Mapping[PrefixKey, Sequence[int]]) -> ContentOf:
    """``content_of`` for a simulated trace: the content ids of the request's routing key."""
    def content_of(request: RouteRequest) -> Sequence[int]:
        return content[request.key]
    return content_of


@dataclass(frozen=True, slots=True)
class SimilarityRun:
    result: SimResult
    steered: int
    index_entries: int


def simulate_with_similarity(requests: Sequence[TraceRequest],
                             content: Mapping[PrefixKey, Sequence[int]], config: SimConfig,
                             opts: SimilarityOptions = SimilarityOptions()) -> SimilarityRun:
    """:func:`loadtest.sim.simulate` with ``config.policy`` plus the similarity scorer.

    The decision time the simulator reports includes the sketch, the LSH query and the record.
    """
    router = SimilarityRouter(config.policy, content_lookup(content), config.policy_options, opts)
    sim = ClusterSim(config, router)
    result = dataclasses.replace(sim.run(requests), policy=router.name)
    return SimilarityRun(result, router.steered, len(router.index))


def similarity_metrics(requests: Sequence[TraceRequest],
                       content: Mapping[PrefixKey, Sequence[int]], config: SimConfig,
                       mode: Mode, pooled: float) -> Metrics:
    """The simulator's metrics of ``config.policy`` plus the hint, and how often it steered."""
    run = simulate_with_similarity(requests, content, config, SimilarityOptions(mode=mode))
    out = metrics(run.result, pooled)
    out["similarity_steered"] = run.steered
    return out


# -- the evaluation (BENCHMARKS.md, "MinHash-LSH similarity hint") -------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    rag_options: tuple[tuple[str, int], ...]
    workers: int
    cache_blocks: int


WORKLOADS: tuple[Workload, ...] = (
    # Tenant system prompt (4 blocks) + 4 chunks of 2 blocks + question: the common RAG shape.
    Workload("rag", (), 8, 300),
    # No system prompt: the retrieved chunks come first, so a new order is a cold prefix.
    Workload("rag-nosys", (("system_blocks", 0),), 8, 300),
    # ... and one-block chunks: a first chunk alone is under min_match_blocks (2).
    Workload("rag-nosys-1blk", (("system_blocks", 0), ("chunk_blocks", 1)), 8, 200),
)

# (label, gateway policy, min_match_blocks or None for the default, similarity mode or None)
VARIANTS: tuple[tuple[str, str, int | None, Mode | None], ...] = (
    ("round_robin", "round_robin", None, None),
    ("consistent_hash", "consistent_hash", None, None),
    ("cache_aware", "cache_aware", None, None),
    ("cache_aware+sim(cold)", "cache_aware", None, "cold"),
    ("cache_aware+sim(tiebreak)", "cache_aware", None, "tiebreak"),
    ("cache_aware[mm=1]", "cache_aware", 1, None),
    ("cache_aware[mm=1]+sim(cold)", "cache_aware", 1, "cold"),
)

_ROW_KEYS = ("block_hit_rate", "pooled_bound", "hit_over_bound", "prefill_max_over_mean",
             "routed_max_over_mean", "decision_us_p50", "decision_us_p99")


def evaluate_one(workload: Workload, seed: int, requests: int, variant: int) -> dict[str, object]:
    """One (workload, seed, variant) cell of the evaluation, as a flat row."""
    label, policy, min_match, mode = VARIANTS[variant]
    spec = dataclasses.replace(RagSpec(requests=requests, seed=seed),
                               **dict(workload.rag_options))
    trace = rag_trace(spec)
    reqs = list(trace.requests)
    pooled = pooled_bound(reqs, workload.workers * workload.cache_blocks)
    options = PolicyOptions()
    if min_match is not None:
        options = dataclasses.replace(options, min_match_blocks=min_match)
    config = SimConfig(workload.workers, workload.cache_blocks, policy, policy_options=options)
    if mode is None:
        m = metrics(simulate(reqs, config), pooled)
        m["similarity_steered"] = 0
    else:
        m = similarity_metrics(reqs, trace.content_by_key(), config, mode, pooled)
    shape = rag_shape(trace, spec)
    row: dict[str, object] = {"workload": workload.name, "seed": seed, "policy": label}
    row.update({k: m[k] for k in _ROW_KEYS})
    row["steered"] = m["similarity_steered"]
    row["same_first_chunk"] = shape.same_first_chunk
    row["seen_content_new_order"] = shape.seen_content_new_order
    return row


def _f(row: Mapping[str, object], key: str) -> float:
    value = row[key]
    assert isinstance(value, int | float)
    return float(value)


def markdown_rows(rows: Sequence[Mapping[str, object]]) -> str:
    lines = ["| workload | seed | policy | block hit | pooled | hit/bound | prefill max/mean "
             "| routed max/mean | decision p50 / p99 (us) | steered |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['seed']} | {r['policy']} | {_f(r, 'block_hit_rate'):.4f} "
            f"| {_f(r, 'pooled_bound'):.4f} | {_f(r, 'hit_over_bound'):.3f} "
            f"| {_f(r, 'prefill_max_over_mean'):.2f} | {_f(r, 'routed_max_over_mean'):.2f} "
            f"| {_f(r, 'decision_us_p50'):.0f} / {_f(r, 'decision_us_p99'):.0f} "
            f"| {r['steered']} |"
        )
    return "\n".join(lines)


def markdown_means(rows: Sequence[Mapping[str, object]]) -> str:
    """Mean over seeds per (workload, policy), with the hit rate's spread (min..max)."""
    groups: dict[tuple[str, str], list[Mapping[str, object]]] = {}
    for r in rows:
        groups.setdefault((str(r["workload"]), str(r["policy"])), []).append(r)
    lines = ["| workload | policy | seeds | block hit (min..max) | hit/bound | prefill max/mean "
             "| routed max/mean | decision p50 (us) |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for (workload, policy), rs in groups.items():
        hits = [_f(r, "block_hit_rate") for r in rs]

        def mean(key: str, rs: Sequence[Mapping[str, object]] = rs) -> float:
            return sum(_f(r, key) for r in rs) / len(rs)

        lines.append(
            f"| {workload} | {policy} | {len(rs)} | {mean('block_hit_rate'):.4f} "
            f"({min(hits):.4f}..{max(hits):.4f}) | {mean('hit_over_bound'):.3f} "
            f"| {mean('prefill_max_over_mean'):.2f} | {mean('routed_max_over_mean'):.2f} "
            f"| {mean('decision_us_p50'):.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.sim.similarity",
        description="Evaluate the MinHash-LSH similarity hint on synthetic RAG workloads.",
    )
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workload", choices=[w.name for w in WORKLOADS], action="append",
                   help="only these workloads (repeatable; default all)")
    p.add_argument("--jobs", type=int, default=1, help="parallel processes")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    try:
        load_datasketch()
    except SimilarityUnavailable as exc:
        p.error(str(exc))
    chosen = [w for w in WORKLOADS if not args.workload or w.name in args.workload]
    cells = [(w, s, v) for w in chosen for s in args.seeds for v in range(len(VARIANTS))]
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(evaluate_one, w, s, args.requests, v) for w, s, v in cells]
            rows = [f.result() for f in futures]
    else:
        rows = [evaluate_one(w, s, args.requests, v) for w, s, v in cells]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown_means(rows))
        print()
        print(markdown_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
