"""Data-parallel engine ranks behind one worker endpoint (``--data-parallel-size N``), as vLLM
serves them.

Each rank is an engine with its own KV cache. A request may name its rank in the
``X-data-parallel-rank`` header (vLLM's) or the body's ``data_parallel_rank`` (SGLang's);
without either the least loaded rank runs it, scored as
vLLM's balancer scores them (``waiting * 4 + running``), equal scores taken in turn so that
idle ranks share the requests. Rank ``r`` publishes its KV events where vLLM's ZMQ publisher
of rank ``r`` binds them: the configured TCP port plus ``r``, or an ``ipc://`` / ``inproc://``
endpoint with ``_dp<r>`` appended. ``/stats`` reports the ranks' totals (:func:`total_stats`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from worker.engines.base import EngineStats
from worker.kvcache import CacheStats

RANK_HEADER = "X-data-parallel-rank"
WAITING_WEIGHT = 4  # a waiting request counts as much as four running ones (vLLM's score)
MAX_PORT = 65_535


def parse_rank(value: str, size: int) -> int:
    """The rank that a ``X-data-parallel-rank`` value names among ``size`` ranks. Raises
    ValueError unless ``value`` is a base-10 integer from 0 to ``size - 1``."""
    digits = value.isascii() and value.isdigit()
    significant = value.lstrip("0") if digits else ""
    if digits and len(significant) <= len(str(size)) and int(significant or "0") < size:
        return int(significant or "0")
    raise ValueError(f"the {RANK_HEADER} header must be an integer from 0 to {size - 1}, "
                     f"got {value[:32]!r}")


def load_score(stats: EngineStats) -> int:
    """How busy a rank is, as vLLM's data-parallel balancer counts it."""
    return stats.waiting * WAITING_WEIGHT + stats.running


def least_loaded(scores: Sequence[int], start: int) -> int:
    """The index of the lowest score; of equal ones, the first at or after ``start`` (wrapping
    around)."""
    size = len(scores)
    if size == 0:
        raise ValueError("no ranks to choose from")
    order = [(start + i) % size for i in range(size)]
    return min(order, key=scores.__getitem__)


class RankPicker:
    """Chooses the rank of requests that name none: the least loaded, equal loads in turn (the
    search starts after the rank chosen last)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size
        self._next = 0

    def pick(self, scores: Sequence[int]) -> int:
        """The rank for the next request, given each rank's :func:`load_score`."""
        if len(scores) != self.size:
            raise ValueError(f"expected {self.size} scores, got {len(scores)}")
        chosen = least_loaded(scores, self._next)
        self._next = (chosen + 1) % self.size
        return chosen


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where rank ``rank`` binds a ZMQ endpoint configured as ``endpoint`` (rank 0's): a TCP
    port plus the rank, an ``ipc://`` or ``inproc://`` endpoint with ``_dp<rank>`` appended.
    Raises ValueError for a TCP endpoint without a port for that rank."""
    if rank == 0 or not endpoint:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not (port.isascii() and port.isdigit()) or int(port) + rank > MAX_PORT:
        raise ValueError(f"KV-event endpoint {endpoint!r} has no port for data-parallel "
                         f"rank {rank}")
    return f"{base}:{int(port) + rank}"


def total_stats(ranks: Sequence[EngineStats]) -> EngineStats:
    """The ranks' stats as one engine's: counts, blocks and seconds summed, the cache's usage
    and occupancy recomputed from the summed blocks (all ranks share one block size)."""
    if not ranks:
        raise ValueError("no ranks to add up")
    caches = [s.cache for s in ranks]
    cache_sums = _sums(caches, CacheStats, skip=("block_size", "usage", "occupancy"))
    blocks = cache_sums["num_blocks"]
    cache = CacheStats(
        **cache_sums,
        block_size=caches[0].block_size,
        usage=cache_sums["referenced_blocks"] / blocks if blocks else 0.0,
        occupancy=cache_sums["used_blocks"] / blocks if blocks else 0.0,
    )
    return EngineStats(**_sums(ranks, EngineStats, skip=("cache",)), cache=cache)


def _sums(items: Sequence[Any], kind: Any, *, skip: Sequence[str]) -> dict[str, Any]:
    """Each field of the dataclass ``kind`` (except ``skip``) summed over ``items``."""
    return {
        f.name: sum(getattr(item, f.name) for item in items)
        for f in fields(kind) if f.name not in skip
    }


def total_by_key(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per-key sums of ``counts`` (the keys in first-seen order)."""
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(total)
