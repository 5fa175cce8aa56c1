"""Sessions of a trace, and the balance no router that keeps each session on one worker can beat.

A request *extends* an earlier one when its prompt starts with all of that one's blocks (a
conversation's or an agent session's next turn, or the same prompt again); a chain of such
requests is one session. Requests that share only part of a prompt (questions on one system
prompt or document) are sessions of their own. A router that keeps every session on one
worker routes each session's whole prompt volume (blocks, cached or not) to that worker, so
over ``N`` workers the routed blocks' max/mean is at least the largest session's volume over
the mean per worker (``largest_over_mean``), and placing whole sessions largest first on the
least loaded worker, knowing every session's volume in advance, reaches ``packed_over_mean``
(within 4/3 of the best packing of whole sessions). A balance target below these is met only
by moving sessions between workers, each move paying one prefill of the session's history.

``python -m loadtest.sessions --workload agent-sessions --skip 2000 --limit 400 --workers 16``
prints them for a trace as the replay harness reads it (same options).

``python -m loadtest.sessions --report REPORT.json`` says where each run of a saved replay
report (``python -m loadtest replay ... --json``) lost hit rate: its routing (the worker each
request went to) is replayed in order, one request at a time, through one LRU cache per
worker of the replay's size and through the pooled cache of the bound; a request's lost
blocks are those the pooled cache had and its worker's cache did not. They are split by
whether the request went where its session's previous request went (a *move* pays a prefill
of the session's history) and by the gateway's decision kind (``x-route-reason``). The
sequential replay ignores the requests in flight together, so its hit rate is printed next to
the live one to show how far that matters.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.harness import reason_kind
from loadtest.traces import TraceRequest
from worker.kvcache import PrefixCache


@dataclass(frozen=True, slots=True)
class StickyBalance:
    sessions: int
    largest_over_mean: float  # no session-sticky router does better
    packed_over_mean: float  # whole sessions packed largest first, volumes known in advance


def session_ids(requests: Sequence[TraceRequest]) -> list[int]:
    """The session of each request (numbered in order of their first request; -1 for an
    empty prompt)."""
    ends: dict[int, int] = {}  # the last block of a prompt seen -> its session
    ids: list[int] = []
    count = 0
    for request in requests:
        blocks = request.blocks
        if not blocks:
            ids.append(-1)
            continue
        # The longest earlier prompt this one extends: its last block is one of ours (block
        # keys name their whole prefix, so equal blocks mean equal prefixes).
        session = next((ends[b] for b in reversed(blocks) if b in ends), None)
        if session is None:
            session = count
            count += 1
        ends[blocks[-1]] = session
        ids.append(session)
    return ids


def session_volumes(requests: Sequence[TraceRequest]) -> list[int]:
    """Prompt blocks per session, sessions in order of their first request."""
    volumes: list[int] = []
    for request, session in zip(requests, session_ids(requests), strict=True):
        if session == len(volumes):
            volumes.append(0)
        if session >= 0:
            volumes[session] += len(request.blocks)
    return volumes


@dataclass(frozen=True, slots=True)
class RunLosses:
    """Where one run's routing lost hit rate (shares of the pooled cache's hits)."""

    router: str
    live_hit_over_bound: float
    replayed_hit_over_bound: float  # the same routing through per-worker LRUs, in order
    moves: int  # requests sent elsewhere than their session's previous request
    lost_on_moves: float
    lost_staying: float
    lost_by_kind: dict[str, float]  # by decision kind ("" where the router gives none)


def previous_in_session(requests: Sequence[TraceRequest]) -> list[int]:
    """For each request, the index of its session's previous request (-1 for a session's
    first, or a request with an empty prompt): what an agent waits for before sending it."""
    last: dict[int, int] = {}
    out: list[int] = []
    for i, session in enumerate(session_ids(requests)):
        out.append(last.get(session, -1) if session >= 0 else -1)
        if session >= 0:
            last[session] = i
    return out


def think_times(requests: Sequence[TraceRequest], before: Sequence[int],
                scale: float) -> list[float]:
    """For each request, the seconds its sender waits after the answer to its session's
    previous request (``before[i]``, -1: none) before sending it: ``scale`` times the time the
    trace puts between the two (an agent's think time or tool call, a chat user's reading),
    0 for a session's first request."""
    return [scale * max(0.0, requests[i].arrival_s - requests[b].arrival_s) if b >= 0 else 0.0
            for i, b in enumerate(before)]


def run_losses(requests: Sequence[TraceRequest], routed_to: Sequence[str],
               reasons: Sequence[str], workers: int, cache_blocks: int,
               router: str = "", live_hit_over_bound: float = 0.0) -> RunLosses:
    """Replay one run's routing (``routed_to[i]``: the worker request ``i`` went to;
    ``reasons[i]``: its ``x-route-reason``, or none) through one LRU cache of
    ``cache_blocks`` blocks per worker and the pooled cache of ``workers`` times that."""
    if len(routed_to) != len(requests) or (reasons and len(reasons) != len(requests)):
        raise ValueError("one worker (and reason, if any) per request")
    pooled = PrefixCache(workers * cache_blocks, 1)
    caches: dict[str, PrefixCache] = {}
    last: dict[int, str] = {}
    bound = hits = moves = 0
    lost_moves = lost_staying = 0
    by_kind: dict[str, int] = {}
    for i, (request, session) in enumerate(zip(requests, session_ids(requests), strict=True)):
        blocks = request.blocks
        if not blocks or len(blocks) > workers * cache_blocks:
            continue  # as the pooled bound counts them
        could = _reuse(pooled, blocks)
        worker = routed_to[i]
        cache = caches.get(worker)
        if cache is None:
            cache = caches[worker] = PrefixCache(cache_blocks, 1)
        got = _reuse(cache, blocks) if len(blocks) <= cache_blocks else 0
        bound += could
        hits += got
        lost = max(0, could - got)
        moved = session in last and last[session] != worker
        last[session] = worker
        if moved:
            moves += 1
            lost_moves += lost
        else:
            lost_staying += lost
        kind = _kind(reasons[i]) if reasons else ""
        by_kind[kind] = by_kind.get(kind, 0) + lost
    share = 1.0 / bound if bound else 0.0
    return RunLosses(
        router=router, live_hit_over_bound=live_hit_over_bound,
        replayed_hit_over_bound=hits * share, moves=moves, lost_on_moves=lost_moves * share,
        lost_staying=lost_staying * share,
        lost_by_kind={k: v * share for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
                      if v},
    )


def _kind(reason: str) -> str:
    """The decision kind an ``x-route-reason`` starts with (``prefix_hit depth=20``:
    ``prefix_hit``), with what diverted or spread the request (``diverted: w1 volume_guard
    (depth=9) -> ...``: ``diverted:volume_guard``)."""
    words = reason.split()
    if not words:
        return ""
    head = reason_kind(reason)
    if head in ("diverted", "spread") and len(words) > 2:
        return f"{head}:{words[2]}"
    return head


def _reuse(cache: PrefixCache, blocks: Sequence[int]) -> int:
    """Blocks of ``blocks`` that ``cache`` already held as a prefix; ``blocks`` are then
    cached there (most recently used)."""
    matched = cache.allocate("r", blocks).matched_blocks
    cache.release("r")
    return matched


def report_losses(path: Path) -> list[RunLosses]:
    """:func:`run_losses` for every live run of a saved replay report, its trace read again
    from the report's command line."""
    from loadtest.replay import load_requests, report_args

    report = json.loads(path.read_text(encoding="utf-8"))
    requests, _ = load_requests(report_args(report))
    config = report["config"]
    return [run_losses(requests, run["routed_to"], run.get("route_reasons") or [],
                       config["workers"], config["cache_blocks"], run["router"],
                       run.get("hit_over_bound", 0.0))
            for run in report["runs"]]


def sticky_balance(requests: Sequence[TraceRequest], workers: int) -> StickyBalance:
    """The routed-blocks max/mean bounds of session-sticky routing over ``workers``."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    volumes = session_volumes(requests)
    mean = sum(volumes) / workers
    if not mean:
        return StickyBalance(len(volumes), 0.0, 0.0)
    bins = [0] * workers
    for volume in sorted(volumes, reverse=True):
        heapq.heapreplace(bins, bins[0] + volume)
    return StickyBalance(len(volumes), max(volumes) / mean, max(bins) / mean)


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.replay import load_requests
    from loadtest.trace_workloads import TRACE_WORKLOADS

    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sessions",
        description="Sessions of a trace and the routed-blocks max/mean no session-sticky "
        "router can beat (the replay harness's trace options).")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="Mooncake jsonl trace (default: the replay's)")
    src.add_argument("--workload", choices=TRACE_WORKLOADS, help="a generated workload")
    parser.add_argument("--requests", type=int, default=0, help="--workload: requests")
    parser.add_argument("--limit", type=int, help="only the first K requests (after --skip)")
    parser.add_argument("--skip", type=int, default=0, help="drop the first S requests")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--workers", type=int, default=4)
    src.add_argument("--report", type=Path,
                     help="a saved replay report (--json): where each run lost hit rate")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(json.dumps([asdict(r) for r in report_losses(args.report)], indent=2))
        return 0
    requests, source = load_requests(args)
    result = sticky_balance(requests, args.workers)
    print(json.dumps({"trace": source, "requests": len(requests), "workers": args.workers,
                      **asdict(result)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
