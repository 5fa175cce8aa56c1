"""Build and lookup cost of the gateway's ring against uhashring's ketama ring, side by side.

``python -m loadtest.bench_ring [--workers 16 1024] [--builds 5] [--lookups 20000]``

For each fleet size both rings are built from the same members (equal weights, and a second
set where every fourth worker has weight 2), alternately, ``--builds`` times; the table gives the
median build time, the median cost of one owner lookup and of one walk to the first three
distinct workers, and the share of anchors on which both rings agree (owner and 3-walk). The
uhashring ring gets each worker's weight as its own ``vnodes`` (``round(40 * weight)``) with
uhashring weight 1, which is how the gateway's ring weights a worker (see
:mod:`gateway.routing.ring`); ``uhashring(weight)`` rows use uhashring's own weights instead
(integers only: a worker's points are relative to the fleet's mean weight there).
``--baseline FILE`` adds the ``Ring`` of another ring module (for example an older revision:
``git show REV:gateway/routing/ring.py > /tmp/ring_rev.py``), built and looked up the same way.
Needs uhashring (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from uhashring import HashRing

from gateway.routing.ring import Ring

_VNODES = 40


def uhash_ring(weights: Mapping[str, float]) -> HashRing:
    """uhashring's ketama ring with the gateway's per-worker point counts."""
    nodes = {wid: {"vnodes": max(1, round(_VNODES * w)), "weight": 1} for wid, w in weights.items()}
    return HashRing(nodes=nodes, hash_fn="ketama", vnodes=_VNODES)


def uhash_ring_own_weights(weights: Mapping[str, float]) -> HashRing:
    """uhashring's ketama ring weighted its own way (integer weights relative to their sum)."""
    return HashRing(nodes={wid: round(w) for wid, w in weights.items()}, hash_fn="ketama",
                    vnodes=_VNODES)


def _median_us(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _per_call_us(fn: Callable[[int], object], anchors: Sequence[int], passes: int) -> float:
    """Median over ``passes`` of the mean cost of one call over ``anchors``."""
    def one_pass() -> None:
        for a in anchors:
            fn(a)
    return _median_us(one_pass, passes) / len(anchors)


class _Subject:
    """One ring implementation under test: build, owner and 3-walk by anchor."""

    def __init__(self, name: str, build: Callable[[Mapping[str, float]], Any], keyed: bool) -> None:
        self.name = name
        self.build = build
        self.keyed = keyed  # uhashring looks keys up by string, the gateway's rings by anchor
        self.ring: Any = None

    def owner(self, anchor: int) -> object:
        if self.keyed:
            return self.ring.get_node(f"{anchor:016x}")
        return self.ring.owner(anchor)

    def walk3(self, anchor: int) -> list[str]:
        if self.keyed:
            return list(islice(self.ring.iterate_nodes(f"{anchor:016x}"), 3))
        return list(islice(self.ring.walk(anchor), 3))


def _load_ring(path: Path) -> Callable[[Mapping[str, float]], Any]:
    spec = importlib.util.spec_from_file_location("ring_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ring_class: Callable[[Mapping[str, float]], Any] = module.Ring
    return ring_class


def measure(n: int, weighted: bool, subjects: Sequence[_Subject], builds: int, lookups: int,
            passes: int) -> list[dict[str, object]]:
    ids = [f"10.0.{i // 256}.{i % 256}:8001" for i in range(n)]
    weights = {wid: (2.0 if weighted and i % 4 == 0 else 1.0) for i, wid in enumerate(ids)}
    anchors = [(i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(lookups)]
    build_s: dict[str, list[float]] = {s.name: [] for s in subjects}
    for _ in range(builds):  # alternate, so all see the same machine load
        for subject in subjects:
            t0 = time.perf_counter()
            subject.ring = subject.build(weights)
            build_s[subject.name].append(time.perf_counter() - t0)
    label = f"{n}{' weighted' if weighted else ''}"
    first = subjects[0]
    rows: list[dict[str, object]] = []
    for subject in subjects:
        rows.append({
            "workers": label, "ring": subject.name,
            "build_ms": statistics.median(build_s[subject.name]) * 1e3,
            "owner_us": _per_call_us(subject.owner, anchors, passes),
            "walk3_us": _per_call_us(subject.walk3, anchors, passes),
            "owner_agree": sum(first.owner(a) == subject.owner(a) for a in anchors) / len(anchors),
            "walk3_agree": sum(first.walk3(a) == subject.walk3(a) for a in anchors) / len(anchors),
        })
    if weighted:
        own = uhash_ring_own_weights(weights)
        rows.append({
            "workers": label, "ring": "uhashring ketama (its own weights)",
            "build_ms": float("nan"), "owner_us": float("nan"), "walk3_us": float("nan"),
            "owner_agree": sum(first.owner(a) == own.get_node(f"{a:016x}") for a in anchors)
            / len(anchors),
            "walk3_agree": float("nan"),
        })
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[16, 1024])
    p.add_argument("--builds", type=int, default=5)
    p.add_argument("--lookups", type=int, default=10_000)
    p.add_argument("--passes", type=int, default=3, help="lookup passes (median)")
    p.add_argument("--baseline", type=Path, metavar="FILE",
                   help="a ring module whose Ring is measured too")
    args = p.parse_args(argv)
    subjects = [_Subject("gateway Ring", Ring, keyed=False)]
    if args.baseline is not None:
        subjects.append(_Subject(f"baseline Ring ({args.baseline.name})",
                                 _load_ring(args.baseline), keyed=False))
    subjects.append(_Subject("uhashring ketama (vnodes per worker)", uhash_ring, keyed=True))
    print("| workers | ring | build ms | owner us | walk-3 us | owner agree | walk-3 agree |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n in args.workers:
        for weighted in (False, True):
            for row in measure(n, weighted, subjects, args.builds, args.lookups, args.passes):
                print(f"| {row['workers']} | {row['ring']} | {row['build_ms']:.1f} | "
                      f"{row['owner_us']:.2f} | {row['walk3_us']:.2f} | "
                      f"{row['owner_agree']:.4f} | {row['walk3_agree']:.4f} |".replace("nan", "-"))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
