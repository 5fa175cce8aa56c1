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
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class StickyBalance:
    sessions: int
    largest_over_mean: float  # no session-sticky router does better
    packed_over_mean: float  # whole sessions packed largest first, volumes known in advance


def session_volumes(requests: Sequence[TraceRequest]) -> list[int]:
    """Prompt blocks per session, sessions in order of their first request."""
    ends: dict[int, int] = {}  # the last block of a prompt seen -> its session
    volumes: list[int] = []
    for request in requests:
        blocks = request.blocks
        if not blocks:
            continue
        # The longest earlier prompt this one extends: its last block is one of ours (block
        # keys name their whole prefix, so equal blocks mean equal prefixes).
        session = next((ends[b] for b in reversed(blocks) if b in ends), None)
        if session is None:
            session = len(volumes)
            volumes.append(0)
        volumes[session] += len(blocks)
        ends[blocks[-1]] = session
    return volumes


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
    args = parser.parse_args(argv)
    requests, source = load_requests(args)
    result = sticky_balance(requests, args.workers)
    print(json.dumps({"trace": source, "requests": len(requests), "workers": args.workers,
                      **asdict(result)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
