"""Consistent hashing over worker ids: uhashring's ketama continuum, built and walked here.

A ring is built once per membership (worker ids and weights) and then only read. ``walk``
returns every worker in ring order from the anchor's position: the first is the anchor's owner,
the next ones are where the anchor moves if that owner is unhealthy or over its load bound.
Because the order depends only on membership and the anchor, every gateway replica computes the
same walk with no coordination; adding a worker moves only the anchors that now land on it.

Points: a worker of weight ``w`` gets ``round(40 * w)`` virtual nodes (at least one) of 4
ketama points each, the md5 of ``"<id>-<i>"`` read as four little-endian 32-bit words, and an
anchor falls where the first word of the md5 of its 16-hex-digit string does. That is exactly
uhashring's ketama ring (``HashRing(hash_fn="ketama")``) with each worker given
``vnodes=round(40 * w)`` and uhashring weight 1: the same continuum, owners and walk order (a
unit test compares them; the one difference is a point two workers share, 32-bit collisions,
which uhashring gives to the worker it inserted last and this ring to the lower id). A worker's
share thus follows its own weight only. uhashring's own
``weight`` is not used because it sizes a node relative to the fleet's summed weights (changing
one worker's weight would move anchors between two other workers) and takes integers only.

Why the continuum is built and walked here instead of inside uhashring: uhashring inserts the
points one by one into a sorted list (``insort``, quadratic in the fleet size) and hashes one
md5 per point rather than one per virtual node; its walk (``range``) copies the continuum's
tail on every call, so its cost grows with the fleet. Here the build is one sort of packed
integers and a walk is a binary search plus a scan that stops as soon as the caller has what it
needs. Measured side by side with ``python -m loadtest.bench_ring`` (BENCHMARKS.md).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterator, Mapping

_VNODES = 40  # virtual nodes per unit of weight
_POINTS = struct.Struct("<4I")  # ketama: 4 points per virtual node, 4 x 32 bits of one md5
_STARTS_KEPT = 4096  # anchors whose continuum position a ring remembers


def ketama_points(name: str) -> tuple[int, int, int, int]:
    """The 4 ketama points of a virtual node name (libketama's and uhashring's values)."""
    points: tuple[int, int, int, int] = _POINTS.unpack(hashlib.md5(name.encode()).digest())
    return points


def ketama_hash(key: str) -> int:
    """Where ``key`` falls on the continuum (the first ketama point of its md5)."""
    return ketama_points(key)[0]


class Ring:
    def __init__(self, weights: Mapping[str, float]) -> None:
        self._ids = tuple(sorted(weights))
        # Each point packed with its owner's index in the low bits: one sort of ints orders the
        # continuum by point, ties by worker id (as sorting (point, id) pairs would).
        shift = max(1, len(self._ids)).bit_length()
        packed: list[int] = []
        for i, wid in enumerate(self._ids):
            for v in range(max(1, round(_VNODES * weights[wid]))):
                packed.extend((p << shift) | i for p in ketama_points(f"{wid}-{v}"))
        packed.sort()
        mask = (1 << shift) - 1
        self._keys = [k >> shift for k in packed]
        self._owners = [self._ids[k & mask] for k in packed]
        # Anchor -> its position on the continuum: a decision walks from one anchor several
        # times (candidates, picker), and recurring prefixes recur; bounded, cleared when full.
        self._starts: dict[int, int] = {}

    def _start(self, anchor: int) -> int:
        start = self._starts.get(anchor)
        if start is None:
            if len(self._starts) >= _STARTS_KEPT:
                self._starts.clear()
            start = self._starts[anchor] = bisect.bisect(
                self._keys, ketama_hash(f"{anchor:016x}"))
        return start

    @property
    def members(self) -> tuple[str, ...]:
        return self._ids

    def walk(self, anchor: int) -> Iterator[str]:
        """Worker ids in ring order from ``anchor``; lazy: callers pay for what they read."""
        if len(self._ids) <= 1:
            yield from self._ids
            return
        owners = self._owners
        size = len(owners)
        start = self._start(anchor)
        seen: set[str] = set()
        for i in range(start, start + size):
            wid = owners[i % size]
            if wid not in seen:
                seen.add(wid)
                yield wid
                if len(seen) == len(self._ids):
                    return

    def owner(self, anchor: int) -> str | None:
        """The first worker of :meth:`walk` (``None`` on an empty ring)."""
        if not self._owners:
            return None
        return self._owners[self._start(anchor) % len(self._owners)]
