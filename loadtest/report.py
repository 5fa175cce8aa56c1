"""The report of a live load test: numbers per policy from the request samples, as JSON, markdown
and PNG plots.

Per policy (one locust run against one fresh cluster):

* ``hit_rate``: sum of worker-reported matched tokens / sum of input tokens, over successful
  requests (what prefill the cluster's caches saved);
* ``ttft_p50_ms`` / ``ttft_p99_ms``: time to the first streamed token; ``latency_*``: the
  whole answer;
* ``rps``: successful requests per second of the measured window; ``errors`` and their kinds;
* ``per_worker``: requests, share and hit rate per worker (``x-route-worker``), and
  ``max_over_mean`` of the request counts;
* ``timeline``: per ``bucket_s`` window, the cumulative and the windowed hit rate and the
  requests per second (the "hit rate over time" plot).

Plots (matplotlib, Agg backend, imported only when plotting): ``hit_rate.png`` (hit rate over
time, one line per policy) and ``worker_load.png`` (each worker's share of the requests,
grouped by policy).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.samples import Sample, percentile

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class WorkerShare:
    requests: int
    share: float
    hit_rate: float
    input_tokens: int
    matched_tokens: int


@dataclass(frozen=True, slots=True)
class TimePoint:
    t: float  # end of the window, seconds since the test started
    hit_rate: float  # cumulative up to t
    window_hit_rate: float  # within the window
    rps: float  # successful requests per second within the window


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    workload: str
    duration_s: float
    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    rps: float
    hit_rate: float
    input_tokens: int
    matched_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    per_worker: dict[str, WorkerShare]
    max_over_mean: float
    timeline: list[TimePoint]
    gateway_hit_rate: float | None = None  # the gateway's own tally (/admin/workers)


@dataclass(slots=True)
class RunReport:
    command: str
    config: dict[str, Any]
    results: list[PolicyResult] = field(default_factory=list)
    schema: int = SCHEMA_VERSION


def _error_kind(error: str) -> str:
    return error.split(":", 1)[0][:60] or "error"


def summarize(policy: str, workload: str, samples: Sequence[Sample], duration_s: float,
              workers: Sequence[str] = (), bucket_s: float = 2.0,
              gateway_hit_rate: float | None = None) -> PolicyResult:
    """One policy's numbers from its samples (``workers``: ids to list even with no requests)."""
    ok = [s for s in samples if s.ok]
    bad = [s for s in samples if not s.ok]
    inputs = sum(s.input_tokens for s in ok)
    matched = sum(s.matched_tokens for s in ok)
    ttfts = [s.ttft_ms for s in ok if s.ttft_ms is not None]
    latencies = [s.latency_ms for s in ok]
    per: dict[str, list[Sample]] = {w: [] for w in workers}
    for s in ok:
        per.setdefault(s.worker or "(none)", []).append(s)
    per_worker = {
        wid: WorkerShare(
            requests=len(items),
            share=len(items) / len(ok) if ok else 0.0,
            hit_rate=_ratio(sum(s.matched_tokens for s in items),
                            sum(s.input_tokens for s in items)),
            input_tokens=sum(s.input_tokens for s in items),
            matched_tokens=sum(s.matched_tokens for s in items),
        )
        for wid, items in sorted(per.items())
    }
    counts = [w.requests for w in per_worker.values()]
    mean = sum(counts) / len(counts) if counts else 0.0
    span = duration_s if duration_s > 0 else max((s.t for s in samples), default=0.0)
    return PolicyResult(
        policy=policy,
        workload=workload,
        duration_s=round(span, 3),
        requests=len(samples),
        ok=len(ok),
        errors=len(bad),
        error_kinds=dict(Counter(_error_kind(s.error) for s in bad).most_common()),
        rps=len(ok) / span if span > 0 else 0.0,
        hit_rate=_ratio(matched, inputs),
        input_tokens=inputs,
        matched_tokens=matched,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        per_worker=per_worker,
        max_over_mean=max(counts) / mean if mean else 0.0,
        timeline=timeline(ok, bucket_s),
        gateway_hit_rate=gateway_hit_rate,
    )


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def timeline(ok: Sequence[Sample], bucket_s: float) -> list[TimePoint]:
    """Hit rate (cumulative and per window) and throughput per ``bucket_s`` window, by the
    time each request was sent."""
    if not ok or bucket_s <= 0:
        return []
    buckets: dict[int, list[Sample]] = {}
    for s in ok:
        buckets.setdefault(int(s.t // bucket_s), []).append(s)
    points: list[TimePoint] = []
    cum_in = cum_matched = 0
    for b in range(max(buckets) + 1):
        items = buckets.get(b, [])
        w_in = sum(s.input_tokens for s in items)
        w_matched = sum(s.matched_tokens for s in items)
        cum_in += w_in
        cum_matched += w_matched
        points.append(TimePoint(
            t=round((b + 1) * bucket_s, 3),
            hit_rate=_ratio(cum_matched, cum_in),
            window_hit_rate=_ratio(w_matched, w_in),
            rps=len(items) / bucket_s,
        ))
    return points


# -- output --------------------------------------------------------------------------------------


def to_dict(report: RunReport) -> dict[str, Any]:
    return asdict(report)


def to_json(report: RunReport) -> str:
    return json.dumps(to_dict(report), indent=2)


def to_markdown(report: RunReport, plots: Sequence[str] = ()) -> str:
    c = report.config
    lines = [
        "```",
        report.command,
        "```",
        "",
        f"Workload `{c.get('workload')}`, {c.get('users')} locust users (think time "
        f"{c.get('think_time', 0)} s), {c.get('duration_s')} s per policy, "
        f"{c.get('workers')} workers ({c.get('cache_blocks')} cache blocks each), "
        f"max_tokens {c.get('max_tokens')}, seed {c.get('seed')}, streaming. Hit rate = "
        "worker-reported matched / input tokens; TTFT = time to the first streamed token.",
        "",
        "| policy | hit rate | TTFT p50 ms | TTFT p99 ms | latency p50 ms | requests/s | "
        "requests per worker | max/mean | errors |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in report.results:
        shares = " / ".join(str(w.requests) for w in r.per_worker.values())
        lines.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | "
            f"{r.latency_p50_ms:.0f} | {r.rps:.1f} | {shares} | {r.max_over_mean:.2f} | "
            f"{r.errors} |"
        )
    errors = [(r.policy, r.error_kinds) for r in report.results if r.error_kinds]
    if errors:
        lines += ["", "Errors by kind:", ""]
        lines += [f"- {p}: " + ", ".join(f"{n} x {k}" for k, n in kinds.items())
                  for p, kinds in errors]
    lines += ["", "Per-worker share and hit rate:", ""]
    for r in report.results:
        parts = ", ".join(f"{wid} {w.share:.0%} ({w.hit_rate:.0%} hit)"
                          for wid, w in r.per_worker.items())
        extra = (f"; the gateway's own tally {r.gateway_hit_rate:.1%}"
                 if r.gateway_hit_rate is not None else "")
        lines.append(f"- {r.policy}: {parts}{extra}")
    if plots:
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_hit_rate(results: Sequence[PolicyResult], path: Path) -> Path:
    """Cumulative hit rate over time, one line per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in results:
        xs = [p.t for p in r.timeline]
        ax.plot(xs, [100 * p.hit_rate for p in r.timeline], marker=".",
                label=f"{r.policy} ({r.hit_rate:.0%})")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("hit rate, % (matched / input tokens, cumulative)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    title = results[0].workload if results else ""
    ax.set_title(f"Affinity hit rate over time: workload {title}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_worker_load(results: Sequence[PolicyResult], path: Path) -> Path:
    """Each worker's share of the requests, bars grouped by policy (shares, not counts, so
    policies with different throughput compare); the dashed line is an even split."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    workers = sorted({w for r in results for w in r.per_worker})
    width = 0.8 / max(1, len(results))
    top = 0.0
    for i, r in enumerate(results):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(workers))]
        ys = [100 * r.per_worker[w].share if w in r.per_worker else 0.0 for w in workers]
        top = max(top, *ys) if ys else top
        ax.bar(xs, ys, width=width,
               label=f"{r.policy} (max/mean {r.max_over_mean:.2f}, {r.ok} requests)")
    if workers:
        ax.axhline(100 / len(workers), color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(workers)))
    ax.set_xticklabels([_short(w) for w in workers], rotation=20, fontsize=8)
    ax.set_xlabel("worker (port)")
    ax.set_ylabel("share of requests, %")
    ax.set_ylim(0, max(top * 1.4, 1.0))
    ax.set_title("Per-worker load")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", fontsize=8, ncol=1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _short(worker_id: str) -> str:
    return worker_id.rsplit(":", 1)[-1] if ":" in worker_id else worker_id


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(report: RunReport, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and (``plots``) the PNGs into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if plots and report.results:
        paths["hit_rate_png"] = plot_hit_rate(report.results, out_dir / "hit_rate.png")
        paths["worker_load_png"] = plot_worker_load(report.results, out_dir / "worker_load.png")
    paths["json"] = out_dir / "report.json"
    paths["json"].write_text(to_json(report) + "\n", encoding="utf-8")
    paths["markdown"] = out_dir / "report.md"
    pngs = [str(p) for k, p in paths.items() if k.endswith("_png")]
    paths["markdown"].write_text(to_markdown(report, pngs), encoding="utf-8")
    return paths
