"""Consistent hashing over worker ids (uhashring, ketama-compatible points).

A ring is built once per membership (worker ids and weights) and then only read. ``walk``
returns every worker in ring order from the anchor's position: the first is the anchor's owner,
the next ones are where the anchor moves if that owner is unhealthy or over its load bound.
Because the order depends only on membership and the anchor, every gateway replica computes the
same walk with no coordination; adding a worker moves only the anchors that now land on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from uhashring import HashRing


class Ring:
    def __init__(self, weights: Mapping[str, float]) -> None:
        self._ids = tuple(sorted(weights))
        # ketama gives each node points in proportion to its weight (an int in uhashring).
        nodes = {wid: {"weight": max(1, round(w * 10))} for wid, w in weights.items()}
        self._ring = HashRing(nodes=nodes, hash_fn="ketama")

    @property
    def members(self) -> tuple[str, ...]:
        return self._ids

    def walk(self, anchor: int) -> Iterator[str]:
        """Worker ids in ring order from ``anchor``; lazy: callers pay for what they read."""
        if len(self._ids) <= 1:
            yield from self._ids
            return
        for node in self._ring.range(f"{anchor:016x}", size=None, unique=True):
            yield node["nodename"]

    def owner(self, anchor: int) -> str | None:
        return next(self.walk(anchor), None)
