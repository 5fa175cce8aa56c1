"""In-process index of which workers were sent which prefixes: block hash -> holders.

Recorded at decision time (the gateway sends a prompt to a worker, so that worker will hold its
blocks a moment later). Because block hashes are chained, holding block ``i`` of a prompt means
holding its whole prefix, and the longest match of a worker is found by walking the chain from
the first block until the worker no longer appears.

Bounded two ways: at most ``capacity`` block entries (least recently recorded dropped first) and
a ``ttl_s`` after which an entry no longer counts (the worker has probably evicted it). Time is
passed in by the caller, so the simulator can replay traces on its own clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000, ttl_s: float = 600.0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._now = 0.0
        # block hash -> {worker id: time recorded}; order = least recently recorded first.
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def set_time(self, now: float) -> None:
        """Advance the index's clock (seconds, any monotonic origin)."""
        self._now = now

    def record(self, blocks: Sequence[int], worker_id: str) -> None:
        """``worker_id`` now holds every block of ``blocks``."""
        entries = self._entries
        now = self._now
        for h in blocks:
            holders = entries.get(h)
            if holders is None:
                entries[h] = {worker_id: now}
            else:
                holders[worker_id] = now
                entries.move_to_end(h)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``blocks`` it holds (only those > 0)."""
        cutoff = self._now - self._ttl_s
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(blocks):
            holders = self._entries.get(h)
            if not holders:
                break
            fresh = {w for w, t in holders.items() if t >= cutoff}
            alive = fresh if alive is None else alive & fresh
            if not alive:
                break
            for w in alive:
                depth[w] = i + 1
        return depth

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that left (its cache is gone with it)."""
        empty: list[int] = []
        for h, holders in self._entries.items():
            if holders.pop(worker_id, None) is not None and not holders:
                empty.append(h)
        for h in empty:
            del self._entries[h]
