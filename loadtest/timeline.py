"""Per-worker hit rate and index mispredictions over time, from replayed replies.

A *misprediction* is a reply for which the gateway's index expected a deeper cached prefix on the
chosen worker (``x-prefix-match-blocks``) than the worker then matched (``x-cache-matched-*``):
the index believed blocks the worker no longer (or never) held. After a worker restarts (empty
cache) or misreports its cache size, these show how long the index takes to be corrected.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.harness import Reply


def timeline(replies: Sequence[Reply], started: float, bucket_s: float,
             block_tokens: int) -> list[dict[str, Any]]:
    """One point per ``bucket_s`` seconds of send time: per worker, requests, blocks, matched
    blocks, hit rate and mispredictions (plus the same over all workers, key ``*``)."""
    buckets: dict[int, dict[str, dict[str, int]]] = {}
    for r in replies:
        if r.status != 200:
            continue
        slot = buckets.setdefault(int((r.sent_at - started) // bucket_s), {})
        for key in (r.worker, "*"):
            row = slot.setdefault(key, {"requests": 0, "blocks": 0, "matched_blocks": 0,
                                        "mispredicted": 0})
            row["requests"] += 1
            row["blocks"] += r.input_tokens // block_tokens
            matched = r.matched_tokens // block_tokens
            row["matched_blocks"] += matched
            row["mispredicted"] += r.index_blocks > matched
    out = []
    for b in sorted(buckets):
        workers = {
            w: {**row, "hit_rate": row["matched_blocks"] / row["blocks"] if row["blocks"] else 0.0}
            for w, row in sorted(buckets[b].items())
        }
        out.append({"t": b * bucket_s, "workers": workers})
    return out


def write_timeline(points: Sequence[dict[str, Any]], prefix: Path, title: str,
                   events: Sequence[tuple[float, str]] = ()) -> list[Path]:
    """``<prefix>.json`` and, with matplotlib installed, ``<prefix>.png``: hit rate (top) and
    mispredicted replies (bottom) per worker over time; ``events`` (seconds, label), e.g. the
    gateway's rebalance actions, as dotted vertical lines."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = [prefix.with_suffix(".json")]
    paths[0].write_text(json.dumps(list(points), indent=1), encoding="utf-8")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    workers = sorted({w for p in points for w in p["workers"]} - {"*"})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for w in [*workers, "*"]:
        xs = [p["t"] for p in points if w in p["workers"]]
        style = {"color": "black", "linewidth": 2.5} if w == "*" else {"linewidth": 1}
        label = "all workers" if w == "*" else w
        top.plot(xs, [p["workers"][w]["hit_rate"] for p in points if w in p["workers"]],
                 label=label, **style)
        if w != "*":
            bottom.plot(xs, [p["workers"][w]["mispredicted"] for p in points
                             if w in p["workers"]], label=label, **style)
    for t, label in events:
        for ax in (top, bottom):
            ax.axvline(t, color="grey", linestyle=":", linewidth=1)
        bottom.annotate(label, (t, 0), xytext=(2, 2), textcoords="offset points", fontsize=6,
                        rotation=90, color="grey")
    top.set_ylabel("block hit rate")
    top.set_title(title)
    top.legend(fontsize=7, ncol=4)
    bottom.set_ylabel("mispredicted replies")
    bottom.set_xlabel("seconds into the run")
    fig.tight_layout()
    png = prefix.with_suffix(".png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [*paths, png]
