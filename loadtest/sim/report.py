"""Metrics of a simulation run, as one flat dict (``--json``) or markdown."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from loadtest.sim.cluster import SimResult

Metrics = dict[str, object]

# Columns of the side-by-side table: (metric key, header, format).
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("ring_seed", "ring seed", "{}"),
    ("block_hit_rate", "block hit", "{:.3f}"),
    ("pooled_bound", "pooled bound", "{:.3f}"),
    ("hit_over_bound", "hit / bound", "{:.3f}"),
    ("prefill_max_over_mean", "prefill max/mean", "{:.2f}"),
    ("routed_max_over_mean", "routed max/mean", "{:.2f}"),
    ("ttft_p50", "TTFT p50 (s)", "{:.2f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.2f}"),
    ("decision_us_p50", "decision p50 (us)", "{:.1f}"),
    ("decision_us_p99", "decision p99 (us)", "{:.1f}"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def max_over_mean(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 0.0


def metrics(result: SimResult, pooled: float) -> Metrics:
    """The flat metrics of one run (``pooled``: the pooled-cache bound of the same sequence)."""
    hit = result.matched_blocks / result.blocks if result.blocks else 0.0
    return {
        "policy": result.policy,
        "workers": result.workers,
        "cache_blocks": result.cache_blocks,
        "mode": result.mode,
        "concurrency": result.concurrency,
        "ring_seed": result.ring_seed,
        "speedup": result.speedup if result.mode == "replay" else None,
        "requests": result.requests,
        "rejected": result.rejected,
        "block_hit_rate": hit,
        "pooled_bound": pooled,
        "hit_over_bound": hit / pooled if pooled else 0.0,
        # What the policy believed it would reuse (the index's match at decision time).
        "predicted_hit_rate": result.predicted_blocks / result.blocks if result.blocks else 0.0,
        # The deepest prefix the index knew any worker to hold (prefix-index policies only):
        # the gap to predicted_hit_rate is what the load filter and the scorers gave up.
        "index_best_hit_rate": (
            result.best_known_blocks / result.blocks if result.blocks else 0.0
        ),
        "prefill_max_over_mean": max_over_mean([w.uncached_blocks for w in result.per_worker]),
        "routed_max_over_mean": max_over_mean([w.routed for w in result.per_worker]),
        "ttft_p50": percentile(result.ttft_s, 50),
        "ttft_p99": percentile(result.ttft_s, 99),
        "decision_us_p50": percentile(result.decision_us, 50),
        "decision_us_p99": percentile(result.decision_us, 99),
        "reasons": dict(sorted(result.reasons.items())),
        # Shares of all blocks (SimConfig.loss_breakdown): the hit rate is the pooled LRU's
        # minus routed_elsewhere and evicted_fleet_wide, plus kept_longer.
        **({"losses": {k: round(v / result.blocks, 4) for k, v in sorted(result.losses.items())}}
           if result.losses and result.blocks else {}),
        "sim_seconds": result.sim_seconds,
        "wall_seconds": result.wall_seconds,
        "per_worker": {
            w.id: {
                "routed": w.routed,
                "blocks": w.blocks,
                "matched_blocks": w.matched_blocks,
                "uncached_blocks": w.uncached_blocks,
                "hit_rate": round(w.hit_rate, 4),
                "max_queue": w.max_queue,
            }
            for w in result.per_worker
        },
    }


def _fmt(value: object, spec: str) -> str:
    return spec.format(value) if value is not None else "-"


def markdown_one(m: Mapping[str, object]) -> str:
    """A single run: one ``- key: value`` line per metric, then per-worker counts."""
    lines = [f"## {m['policy']}: {m['workers']} workers x {m['cache_blocks']} blocks"]
    for key, value in m.items():
        if key == "per_worker":
            continue
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"- {key}: {shown}")
    per_worker = m.get("per_worker")
    if isinstance(per_worker, Mapping):
        lines += ["", "| worker | routed | blocks | uncached | hit rate | max queue |",
                  "|---|---:|---:|---:|---:|---:|"]
        for wid, row in per_worker.items():
            lines.append(
                f"| {wid} | {row['routed']} | {row['blocks']} | {row['uncached_blocks']} "
                f"| {row['hit_rate']:.3f} | {row['max_queue']} |"
            )
    return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, object]]) -> str:
    """Policies side by side (one row each)."""
    if not rows:
        return ""
    first = rows[0]
    mode = str(first["mode"])
    if first["mode"] == "replay":
        mode += f", speedup {first['speedup']}"
    mode += f", concurrency {first['concurrency'] or 'unbounded'}"
    lines = [
        f"{first['workers']} workers x {first['cache_blocks']} blocks, "
        f"{first['requests']} requests ({mode})",
        "",
        "| " + " | ".join(h for _, h, _ in TABLE_COLUMNS) + " |",
        "|---|" + "---:|" * (len(TABLE_COLUMNS) - 1),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k), f) for k, _, f in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


# Columns of the summary over ring seeds: (metric key, header, how to summarise).
SEED_COLUMNS: tuple[tuple[str, str], ...] = (
    ("hit_over_bound", "hit / bound"),
    ("prefill_max_over_mean", "prefill max/mean"),
    ("routed_max_over_mean", "routed max/mean"),
    ("ttft_p50", "TTFT p50 (s)"),
    ("ttft_p99", "TTFT p99 (s)"),
)


def seed_summary(rows: Sequence[Mapping[str, object]]) -> list[Metrics]:
    """Per policy, over its runs with different ring seeds: mean, min and max of each metric
    of :data:`SEED_COLUMNS`. Small changes move single runs of a trace this chaotic by more
    than the differences between good settings; the spread over seeds says how much."""
    by_policy: dict[str, list[Mapping[str, object]]] = {}
    for row in rows:
        by_policy.setdefault(str(row["policy"]), []).append(row)
    out: list[Metrics] = []
    for policy, runs in by_policy.items():
        entry: Metrics = {"policy": policy, "seeds": [r["ring_seed"] for r in runs]}
        for key, _ in SEED_COLUMNS:
            values = [float(str(r[key])) for r in runs]
            entry[key] = {"mean": sum(values) / len(values), "min": min(values),
                          "max": max(values)}
        out.append(entry)
    return out


def markdown_seed_summary(summary: Sequence[Mapping[str, object]]) -> str:
    """One row per policy: each metric as ``mean (min-max)`` over the ring seeds."""
    if not summary:
        return ""
    lines = [
        "| policy | seeds | " + " | ".join(h for _, h in SEED_COLUMNS) + " |",
        "|---|---:|" + "---:|" * len(SEED_COLUMNS),
    ]
    for entry in summary:
        seeds = entry["seeds"]
        cells = [str(entry["policy"]), str(len(seeds) if isinstance(seeds, list) else seeds)]
        for key, _ in SEED_COLUMNS:
            stats = entry[key]
            assert isinstance(stats, Mapping)
            cells.append(f"{stats['mean']:.3f} ({stats['min']:.3f}-{stats['max']:.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
