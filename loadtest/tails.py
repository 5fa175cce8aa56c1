"""Which requests make each router's latency tail, by the kind of request they are.

A replay's p99 is a handful of requests per run (4 of 400), and which ones they are decides
what to change: on the agent-session windows ours and sglang-router have the same p99, but
ours is made by new sessions in the middle of the window and sglang-router's by the window's
first requests (BENCHMARKS.md, "what makes the agent windows' p99"). Every request of the
trace is classed once, by what the reference run (the first gateway run:
:func:`loadtest.paired.reference_router`) found cached for it in most repeats:

* ``start``: one of the first ``concurrency`` requests, sent before any answer of the run came
  back, into empty queues, by every router alike;
* ``prefill``: its worker reused less than half of its prompt (a new session, a cold prompt,
  a session moved): it prefilled most of it;
* ``reuse``: its worker reused at least half.

For each router and class, over the repeats: the requests, the p50 and p90 latency, the median
over the class's requests of each one's latency through the router over its latency through
the reference (each the median over the repeats; the same trace request on the same fleets),
and how many of the requests at or over each repeat's p99 were of the class. ``python -m
loadtest replay`` reports it (``tails`` in the JSON, a table after the paired comparison).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loadtest.harness import percentile
from loadtest.paired import Named, reference_router

KINDS = ("start", "prefill", "reuse")


class Run(Named, Protocol):
    """What the breakdown reads of a run (:class:`loadtest.replay.RunResult`)."""

    @property
    def repeat(self) -> int: ...

    @property
    def latencies_ms(self) -> list[float]: ...

    @property
    def cached_blocks(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class KindTail:
    kind: str
    requests: int  # requests of the trace in this class
    p50_ms: float
    p90_ms: float
    # Median over the class's requests of (this router's latency / the reference's), each
    # the request's median over the repeats; None for the reference itself.
    ratio: float | None
    in_tail: int  # requests of the class at or over their repeat's p99, over the repeats


@dataclass(frozen=True, slots=True)
class RouterTails:
    router: str
    reference: str
    repeats: int
    kinds: tuple[KindTail, ...]  # in KINDS order, classes with no request left out


def request_kinds(runs: Sequence[Run], prompt_blocks: Sequence[int],
                  concurrency: int) -> list[str]:
    """Each request's class (see the module docstring), from the reference runs' cached
    blocks; ``prompt_blocks``: each request's prompt in the same blocks."""
    kinds = ["start" if i < concurrency else "reuse" for i in range(len(prompt_blocks))]
    reference = reference_router(runs)
    cached = [r.cached_blocks for r in runs
              if r.router == reference and len(r.cached_blocks) == len(prompt_blocks)]
    if not cached:
        return kinds
    for i in range(concurrency, len(prompt_blocks)):
        reused = statistics.median(c[i] for c in cached)
        if 2 * reused < prompt_blocks[i]:
            kinds[i] = "prefill"
    return kinds


def _tail(latencies: Sequence[float]) -> set[int]:
    """The requests at or over the run's p99."""
    line = percentile(latencies, 99)
    return {i for i, ms in enumerate(latencies) if ms >= line}


def tails(runs: Sequence[Run], prompt_blocks: Sequence[int],
          concurrency: int) -> list[RouterTails]:
    """Every router's latency by request class, in first-seen order (runs whose latencies do
    not cover the trace are left out; empty without a reference)."""
    n = len(prompt_blocks)
    runs = [r for r in runs if len(r.latencies_ms) == n]
    reference = reference_router(runs)
    if reference is None or n == 0:
        return []
    kinds = request_kinds(runs, prompt_blocks, concurrency)
    by_router: dict[str, list[Run]] = {}
    for run in runs:
        by_router.setdefault(run.router, []).append(run)

    def medians(rs: Sequence[Run]) -> list[float]:
        return [statistics.median(r.latencies_ms[i] for r in rs) for i in range(n)]

    base = medians(by_router[reference])
    members_of = {kind: [i for i in range(n) if kinds[i] == kind] for kind in KINDS}
    out = []
    for router, rs in by_router.items():
        own = medians(rs) if router != reference else base
        in_tail: Counter[str] = Counter()
        for run in rs:
            in_tail.update(kinds[i] for i in _tail(run.latencies_ms))
        rows = []
        for kind, members in members_of.items():
            if not members:
                continue
            pooled = [r.latencies_ms[i] for r in rs for i in members]
            ratio = None if router == reference else statistics.median(
                own[i] / base[i] if base[i] else 1.0 for i in members)
            rows.append(KindTail(kind, len(members), statistics.median(pooled),
                                 percentile(pooled, 90), ratio, in_tail[kind]))
        out.append(RouterTails(router, reference, len(rs), tuple(rows)))
    return out


def markdown(rows: Sequence[RouterTails]) -> str:
    """The breakdown as a table (empty without rows)."""
    if not rows:
        return ""
    kinds = [k.kind for k in rows[0].kinds]
    counts = ", ".join(f"{k.kind} {k.requests}" for k in rows[0].kinds)
    lines = ["", f"Latency by request ({counts}; classed by what {rows[0].reference} "
             "reused), p50 / p90 ms, the median request's latency over the reference's, and "
             "the requests at or over each repeat's p99:", "",
             "| router | " + " | ".join(kinds) + " | at or over p99 (" + " / ".join(kinds)
             + ") |",
             "|---|" + "---|" * len(kinds) + "---|"]
    for row in rows:
        by_kind = {k.kind: k for k in row.kinds}
        cells = []
        for kind in kinds:
            k = by_kind.get(kind)
            if k is None:
                cells.append("-")
                continue
            versus = "" if k.ratio is None else f", {k.ratio:.2f}x"
            cells.append(f"{k.p50_ms:.1f} / {k.p90_ms:.1f}{versus}")
        tail = " / ".join(str(by_kind[k].in_tail) if k in by_kind else "0" for k in kinds)
        lines.append(f"| {row.router} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines) + "\n"
