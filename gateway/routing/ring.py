"""Consistent hashing over worker ids, with ketama points (the same as uhashring's ketama ring).

A ring is built once per membership (worker ids and weights) and then only read. ``walk``
returns every worker in ring order from the anchor's position: the first is the anchor's owner,
the next ones are where the anchor moves if that owner is unhealthy or over its load bound.
Because the order depends only on membership and the anchor, every gateway replica computes the
same walk with no coordination; adding a worker moves only the anchors that now land on it.

Points: a worker of weight ``w`` gets ``round(40 * w)`` virtual nodes of 4 ketama points each
(the md5-based ketama hash of ``"<id>-<i>"``, as uhashring and libketama compute it; a unit
test checks owners against uhashring's ketama ring), so its
share of the ring follows its weight and does not depend on the other workers' weights. The
continuum is one sorted array built with a sort (uhashring inserts point by point, quadratic in
the fleet size), and a walk is a binary search plus a scan that stops as soon as the caller has
what it needs, so looking up an anchor costs O(log points) however large the fleet.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterator, Mapping

_VNODES = 40  # virtual nodes per unit of weight
_POINTS = struct.Struct("<4I")  # ketama: 4 points per virtual node, 4 x 32 bits of one md5


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
        points: list[tuple[int, str]] = []
        for wid in self._ids:
            for v in range(max(1, round(_VNODES * weights[wid]))):
                points.extend((p, wid) for p in ketama_points(f"{wid}-{v}"))
        points.sort()
        self._keys = [p for p, _ in points]
        self._owners = [wid for _, wid in points]

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
        start = bisect.bisect(self._keys, ketama_hash(f"{anchor:016x}"))
        seen: set[str] = set()
        for i in range(start, start + size):
            wid = owners[i % size]
            if wid not in seen:
                seen.add(wid)
                yield wid
                if len(seen) == len(self._ids):
                    return

    def owner(self, anchor: int) -> str | None:
        return next(self.walk(anchor), None)
