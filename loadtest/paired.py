"""Routers compared repeat by repeat, against the first gateway run of a replay.

``python -m loadtest replay --repeat R`` starts a fresh fleet for every repeat and runs every
router on it, one after the other. What moves from one repeat to the next (the machine's
speed, which session lands where first) moves all the routers of a repeat together, and it is
most of the spread: on the agent-session windows one fleet's routed max/mean differs from the
next one's by 0.15-0.3 for the same code, and the medians of 9 fleets of the same code moved
0.19 from one run to the next, minutes apart. A difference taken within each repeat cancels
that. For each router other than the reference (the first of our gateway's runs: its first
policy without a variant), over the repeats both ran:

* ``hit_over_bound`` and ``routed_max_over_mean``: the median of the per-repeat differences
  (router minus reference);
* ``p99_ms``: the median of the per-repeat ratios (router over reference);
* for each, in how many repeats the router's figure was lower and higher, and the two-sided
  sign test of those counts (:func:`sign_test`): the chance of a split at least as uneven if
  neither router tended to be lower. Nine repeats all one way give 0.004; 7 of 9 give 0.18.

The replay reports it (``paired`` in the JSON, a table after the medians), so a routing
change run as ``--gateway-variant`` beside the default reads as a paired comparison, not as
two medians that each carry the fleets' spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Named(Protocol):
    """A run, by the router that made it."""

    @property
    def router(self) -> str: ...


class Run(Named, Protocol):
    """What the comparison reads of a run (:class:`loadtest.replay.RunResult`)."""

    @property
    def repeat(self) -> int: ...

    @property
    def hit_over_bound(self) -> float: ...

    @property
    def routed_max_over_mean(self) -> float: ...

    @property
    def p99_ms(self) -> float: ...


@dataclass(frozen=True, slots=True)
class PairedMetric:
    """One metric of one router against the reference, repeat by repeat: the median of the
    per-repeat differences (or ratios), the repeats where the router's figure was lower and
    higher, and the two-sided sign test of those counts."""

    median: float
    lower: int
    higher: int
    sign_p: float


@dataclass(frozen=True, slots=True)
class Paired:
    router: str
    reference: str
    repeats: int  # repeats both ran
    hit_over_bound: PairedMetric  # differences
    routed_max_over_mean: PairedMetric  # differences
    p99_ms: PairedMetric  # ratios


def sign_test(lower: int, higher: int) -> float:
    """Two-sided sign test: the chance, for ``lower + higher`` fair coin flips, of a split at
    least as uneven as ``lower`` against ``higher`` (1.0 with no flips)."""
    n = lower + higher
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lower, higher) + 1))
    return min(1.0, 2.0 * tail / (1 << n))


def reference_router(runs: Sequence[Named]) -> str | None:
    """The router the others are compared with: the first of our gateway's runs that is not
    a variant (``ours:POLICY``), else the first run's router; None without runs."""
    for run in runs:
        if run.router.startswith("ours:"):
            return run.router
    return runs[0].router if runs else None


def _metric(values: Sequence[float], neutral: float) -> PairedMetric:
    lower = sum(1 for v in values if v < neutral)
    higher = sum(1 for v in values if v > neutral)
    return PairedMetric(statistics.median(values), lower, higher, sign_test(lower, higher))


def paired(runs: Sequence[Run], reference: str | None = None) -> list[Paired]:
    """Every router but the reference against it, over the repeats both ran (routers sharing
    fewer than two repeats with it are left out), in first-seen order."""
    reference = reference or reference_router(runs)
    by_router: dict[str, dict[int, Run]] = {}
    for run in runs:
        by_router.setdefault(run.router, {})[run.repeat] = run
    if reference is None or reference not in by_router:
        return []
    base = by_router[reference]
    out = []
    for router, repeats in by_router.items():
        shared = sorted(set(repeats) & set(base))
        if router == reference or len(shared) < 2:
            continue
        both = [(repeats[k], base[k]) for k in shared]
        out.append(Paired(
            router=router, reference=reference, repeats=len(both),
            hit_over_bound=_metric([a.hit_over_bound - b.hit_over_bound for a, b in both], 0.0),
            routed_max_over_mean=_metric(
                [a.routed_max_over_mean - b.routed_max_over_mean for a, b in both], 0.0),
            p99_ms=_metric([a.p99_ms / b.p99_ms if b.p99_ms else math.inf for a, b in both],
                           1.0),
        ))
    return out


def markdown(rows: Sequence[Paired]) -> str:
    """The comparison as a table (empty without rows)."""
    if not rows:
        return ""

    def cell(m: PairedMetric, fmt: str, unit: str = "") -> str:
        return (f"{m.median:{fmt}}{unit} (lower in {m.lower}, higher in {m.higher}; "
                f"sign test {m.sign_p:.2f})")

    lines = [f"Each router against {rows[0].reference}, repeat by repeat (median of the "
             "per-repeat differences; p99 as a ratio):", "",
             "| router | repeats | hit / bound | routed blocks max/mean | p99 |",
             "|---|---:|---|---|---|"]
    lines += [f"| {r.router} | {r.repeats} | {cell(r.hit_over_bound, '+.4f')} | "
              f"{cell(r.routed_max_over_mean, '+.3f')} | {cell(r.p99_ms, '.3f', 'x')} |"
              for r in rows]
    return "\n".join(lines) + "\n"
