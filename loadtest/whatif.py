"""What a routing change would have done on saved live runs, paired run by run.

``python -m loadtest.whatif --set NAME=VALUE [--set ...] [--draws N] [--jobs J] [--json]
REPORT...``

Each REPORT is a saved ``python -m loadtest replay ... --json`` report. For every live run of
our gateway in it, the simulator runs on that run's fleet, keys and timing
(:func:`loadtest.replay_sim.simulate_runs`) twice: as the gateway was, and with the change
(``--set`` takes what ``replay --sim-set`` takes: ``policy.cache_aware_load_factor=6``,
``prewarm=false``). ``--draws N`` makes each of them N simulations, the first on the run's own
timing and the others with it jittered, the same jitter for both sides, so every draw is a
pair. The change is measured against the simulator without it, on the same timing, not against
the live run: a jittered draw differs from live by itself.

Runs are grouped by workload (the trace and fleet a report replayed). For each workload the
table gives the live hit / bound and routed max/mean, the simulator's without and with the
change (means over runs of the draws' means), and the paired difference in hit / bound with
how many runs the change raised, the paired difference in the simulated engines' p99 time to
first token (what the fleet's cost model makes of the change's placements; 0 on workers that
cost nothing), then the hit / bound difference at the gateway's own decision instants (one
simulation per run, on the live arrivals).

Single live runs of a trace such as Mooncake 16 x 500 differ by a point of hit / bound from
run to run; a difference that holds pair by pair over many runs and draws is what a live batch
of three could not show.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from loadtest.replay import load_report
from loadtest.replay_sim import Overrides, sim_overrides, simulate_runs


@dataclasses.dataclass(frozen=True)
class Pair:
    """One live run of our gateway, simulated without and with the change."""

    workload: str
    router: str
    live: tuple[float, float]  # hit / bound, routed max/mean
    base: tuple[float, float]  # the simulator's, mean over the draws
    changed: tuple[float, float]
    # At the decision instants (one run each; None when the report has no decision times).
    base_decided: float | None
    changed_decided: float | None
    # The simulated engines' p99 time to first token (ms), mean over the draws.
    base_p99: float = 0.0
    changed_p99: float = 0.0


def workload_label(args: argparse.Namespace) -> str:
    """The trace and fleet a report replayed, in a few words (``agent-sessions, skip 2000,
    400 requests, 16 x 2000``)."""
    parts = [args.workload or (Path(args.trace).name if args.trace else "Mooncake")]
    if args.skip:
        parts.append(f"skip {args.skip}")
    if args.limit:
        parts.append(f"{args.limit} requests")
    elif args.requests:
        parts.append(f"{args.requests} requests")
    fleet = f"{args.workers} x {args.cache_blocks}"
    if not args.report_cache_size:
        fleet += ", size not reported"
    parts.append(fleet)
    if args.tokenizer_file:
        parts.append("token keys" + (", KV events" if args.kv_events else ""))
    return ", ".join(parts)


def report_pairs(path: Path, draws: int, overrides: Overrides) -> list[Pair]:
    """Every live run of our gateway in the report at ``path``, simulated without and with
    ``overrides``."""
    saved = load_report(path)
    label = workload_label(saved.args)
    base = simulate_runs(saved.requests, saved.config, saved.results, draws)
    changed = simulate_runs(saved.requests, saved.config, saved.results, draws, overrides)
    pairs = []
    for without, with_change in zip(base, changed, strict=True):
        for a, b in zip(without["runs"], with_change["runs"], strict=True):
            decided_a, decided_b = a.get("decisions"), b.get("decisions")
            pairs.append(Pair(
                workload=label, router=without["router"],
                live=(a["live"]["hit_over_bound"], a["live"]["routed_max_over_mean"]),
                base=(a["hit_over_bound"], a["routed_max_over_mean"]),
                changed=(b["hit_over_bound"], b["routed_max_over_mean"]),
                base_decided=decided_a["hit_over_bound"] if decided_a else None,
                changed_decided=decided_b["hit_over_bound"] if decided_b else None,
                base_p99=a["ttft_p99_ms"], changed_p99=b["ttft_p99_ms"],
            ))
    return pairs


def _means(points: Sequence[tuple[float, float]]) -> list[float]:
    """The mean hit / bound and the mean routed max/mean of ``points``."""
    return [statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)]


def summarize(pairs: Sequence[Pair]) -> list[dict[str, Any]]:
    """One row per workload and policy, in the order first seen."""
    groups: dict[tuple[str, str], list[Pair]] = {}
    for pair in pairs:
        groups.setdefault((pair.workload, pair.router), []).append(pair)
    rows = []
    for (workload, router), group in groups.items():
        gains = [p.changed[0] - p.base[0] for p in group]
        p99s = [p.changed_p99 - p.base_p99 for p in group]
        decided = [p.changed_decided - p.base_decided for p in group
                   if p.changed_decided is not None and p.base_decided is not None]
        rows.append({
            "workload": workload, "router": router, "runs": len(group),
            "live": _means([p.live for p in group]),
            "simulated": _means([p.base for p in group]),
            "changed": _means([p.changed for p in group]),
            "hit_change": statistics.fmean(gains),
            "runs_raised": sum(1 for g in gains if g > 0),
            "runs_lowered": sum(1 for g in gains if g < 0),
            "balance_change": statistics.fmean(p.changed[1] - p.base[1] for p in group),
            "p99_change_ms": statistics.fmean(p99s),
            "runs_p99_higher": sum(1 for d in p99s if d > 0),
            "runs_p99_lower": sum(1 for d in p99s if d < 0),
            "hit_change_decided": (statistics.fmean(decided) if len(decided) == len(group)
                                   else None),
        })
    return rows


def markdown(rows: Sequence[dict[str, Any]], change: str, draws: int) -> str:
    lines = [
        f"Simulated without and with `{change}`, {draws} draw(s) per live run, paired "
        "(hit / bound @ routed max/mean; means over runs):",
        "",
        "| workload | runs | live | simulated | with the change | hit / bound change "
        "(runs raised, lowered) | balance change | p99 time to first token change, ms (runs "
        "higher, lower) | hit change at the decision instants |",
        "|---|---:|---|---|---|---|---:|---|---:|",
    ]
    for r in rows:
        decided = r["hit_change_decided"]
        lines.append(
            f"| {r['workload']} ({r['router']}) | {r['runs']} | "
            f"{r['live'][0]:.4f} @ {r['live'][1]:.2f} | "
            f"{r['simulated'][0]:.4f} @ {r['simulated'][1]:.2f} | "
            f"{r['changed'][0]:.4f} @ {r['changed'][1]:.2f} | "
            f"{r['hit_change']:+.4f} ({r['runs_raised']}, {r['runs_lowered']}) | "
            f"{r['balance_change']:+.3f} | "
            f"{r['p99_change_ms']:+.1f} ({r['runs_p99_higher']}, {r['runs_p99_lower']}) | "
            + ("-" if decided is None else f"{decided:+.4f}") + " |")
    return "\n".join(lines) + "\n"


def _pairs_of(job: tuple[Path, int, Overrides]) -> list[Pair]:
    return report_pairs(*job)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.whatif", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, metavar="REPORT",
                   help="saved `python -m loadtest replay ... --json` reports")
    p.add_argument("--set", dest="sets", action="append", required=True, metavar="NAME=VALUE",
                   help="the change, as `replay --sim-set` takes it (repeatable)")
    p.add_argument("--draws", type=int, default=1,
                   help="simulations per live run and side (the first on its own timing)")
    p.add_argument("--jobs", type=int, default=1, help="reports simulated at once")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.draws < 1 or args.jobs < 1:
        p.error("--draws and --jobs must be >= 1")
    try:
        overrides = sim_overrides(args.sets)
    except ValueError as exc:
        p.error(str(exc))
    jobs = [(path, args.draws, overrides) for path in args.reports]
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
            per_report = list(pool.map(_pairs_of, jobs))
    else:
        per_report = [_pairs_of(job) for job in jobs]
    rows = summarize([pair for pairs in per_report for pair in pairs])
    change = ", ".join(args.sets)
    if args.json:
        print(json.dumps({"change": change, "draws": args.draws, "rows": rows}, indent=2))
    else:
        print(markdown(rows, change, args.draws), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
