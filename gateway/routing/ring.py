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

_VNODES = 40  # ketama points per unit of weight (x4 hashes each in ketama)


class Ring:
    def __init__(self, weights: Mapping[str, float]) -> None:
        self._ids = tuple(sorted(weights))
        # Points per node in proportion to its own weight. (uhashring's "weight" would scale
        # each node's points by weight / sum of weights, so any membership change would move
        # anchors between the workers that stay.)
        nodes = {
            wid: {"vnodes": max(1, round(_VNODES * w)), "weight": 1} for wid, w in weights.items()
        }
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
