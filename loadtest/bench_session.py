"""What routing costs the gateway per request, in process: the routing session of a decision.

``python -m loadtest.bench_session [--keys prompts mooncake] [--workers 4 16] [--passes 5]
[--requests N] [--baseline DIR]``

Per request, the :class:`~gateway.session.RoutingSession` of the gateway's default settings
(policy ``cache_aware``) decides, commits (records the decision in the prefix index, counts the
request in flight) and, 32 requests later, completes with the reuse its worker reports when the
prediction was right; the microseconds of each of the three, per request, at the median pass.
Two kinds of keys:

* ``prompts``: ``loadtest.bench_overhead``'s requests (20 shared system prompts of about 2,000
  characters, a short question each), parsed and fingerprinted as the gateway does, 0.7 ms
  apart; each worker's cache 4,096 blocks, as its workers report;
* ``mooncake``: the Mooncake conversation trace's keys, 5 ms apart, 500 blocks per worker.

Each pass runs in a child process of its own (a warm-up pass, then the measured one).
``--baseline DIR`` measures the gateway of another checkout too (``git worktree add DIR REV``),
its passes alternating with this one's, and prints the ratio. Single-threaded and in process:
the routing alone, not the gateway (``loadtest.bench_overhead`` measures that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from gateway.__main__ import quiet_collector
from gateway.fingerprint import Namespace, fingerprint
from gateway.openai_schema import parse_chat
from gateway.pool import WorkerPool
from gateway.routing.policies import build_engine
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import RouteRequest
from gateway.session import Attempt, CacheUsage, RoutingSession
from gateway.settings import GatewaySettings
from infra.procs import from_checkout
from loadtest.bench_overhead import OverheadConfig, bodies_for
from loadtest.simulate import DEFAULT_TRACE
from loadtest.traces import read_mooncake

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
IN_FLIGHT = 32  # requests between a decision and its completion
SPACING_S = {"prompts": 0.0007, "mooncake": 0.005}
CAPACITY = {"prompts": 4096, "mooncake": 500}
PARTS = ("decide", "commit", "completed")


def route_requests(keys: str, count: int) -> list[RouteRequest]:
    """The route requests of one kind of keys (``count``: at most that many; 0: all)."""
    if keys == "mooncake":
        return [RouteRequest(key=r.key, model="m", cost_tokens=r.cost_tokens,
                             prompt_tokens=r.input_tokens)
                for r in read_mooncake(DEFAULT_TRACE, limit=count or None)]
    out: list[RouteRequest] = []
    settings = GatewaySettings()
    bodies, _ = bodies_for(OverheadConfig(requests=count or 4000))
    namespace = Namespace(tenant="bench", model="m")
    normal, prints = settings.normalize_options(), settings.fingerprint_options()
    for body in bodies:
        parsed = parse_chat(json.loads(body), normal, None, None, False)
        key = fingerprint(parsed.fingerprint_text, namespace, prints)
        prompt = max(1, parsed.prompt_chars // 4)
        out.append(RouteRequest(key=key, model="m", cost_tokens=prompt + 1,
                                prompt_tokens=prompt))
    return out


def one_pass(keys: str, workers: int, requests: Sequence[RouteRequest]) -> dict[str, float]:
    """Microseconds per request of each part of the routing session, over a fresh pool."""
    settings = GatewaySettings()
    index = PrefixIndex(capacity=settings.index_capacity, ttl_s=settings.index_ttl_s)
    pool = WorkerPool([f"http://127.0.0.1:{9000 + i}" for i in range(workers)], index)
    for state in pool.states():
        pool.mark_up(state.worker.id, frozenset({"m"}))
        pool.set_capacity(state.worker.id, CAPACITY[keys])
    session = RoutingSession(build_engine(settings.policy, settings.policy_options()), index,
                             pool)
    quiet_collector()  # as the gateway runs
    clock = time.perf_counter
    spent = dict.fromkeys(PARTS, 0.0)
    in_flight: deque[Attempt] = deque()
    now = 1000.0
    for request in requests:
        now += SPACING_S[keys]
        t0 = clock()
        attempt = session.decide(request, now)
        t1 = clock()
        session.commit(attempt)
        t2 = clock()
        spent["decide"] += t1 - t0
        spent["commit"] += t2 - t1
        in_flight.append(attempt)
        if len(in_flight) > IN_FLIGHT:
            done = in_flight.popleft()
            route, decision = done.request, done.decision
            total = route.key.total_blocks
            usage = CacheUsage(route.prompt_tokens,
                               route.prompt_tokens * decision.match_blocks // total if total
                               else 0)
            t3 = clock()
            session.completed(done, usage, now)
            spent["completed"] += clock() - t3
    return {part: spent[part] / len(requests) * 1e6 for part in PARTS}


def _child(checkout: Path, keys: str, workers: int, requests: int) -> dict[str, float]:
    """One measured pass (after a warm-up pass) in a child process whose ``gateway`` package
    is ``checkout``'s (this file, run from there: a checkout need not have it)."""
    code = f"import runpy; runpy.run_path({str(HERE)!r}, run_name='__main__')"
    out = subprocess.run(
        from_checkout([sys.executable, "-c", code, "--one-pass", "--keys", keys, "--workers",
                       str(workers), "--requests", str(requests)], str(checkout)),
        check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", nargs="+", choices=("prompts", "mooncake"),
                   default=["prompts", "mooncake"])
    p.add_argument("--workers", type=int, nargs="+", default=[4, 16])
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per pass (0: 4,000 prompts, the whole trace)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="a checkout whose gateway is measured too")
    p.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_pass:
        requests = route_requests(args.keys[0], args.requests)
        one_pass(args.keys[0], args.workers[0], requests)  # warm-up
        print(json.dumps(one_pass(args.keys[0], args.workers[0], requests)))
        return 0
    # Here, not at the top: a child process runs this file against another checkout's
    # loadtest package, which need not have it.
    from loadtest.bench_index import print_row

    subjects = [("this checkout", ROOT)]
    if args.baseline is not None:
        subjects.append((f"baseline ({args.baseline.name})", args.baseline.resolve()))
    cells = " | ".join(f"{name}: decide / commit / completed = us" for name, _ in subjects)
    print(f"| keys | workers | {cells} |" + (" ratio |" if len(subjects) > 1 else ""))
    print("|---|---:|" + "---|" * len(subjects) + ("---:|" if len(subjects) > 1 else ""))
    for keys in args.keys:
        for workers in args.workers:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in subjects}
            for _ in range(args.passes):
                for name, checkout in subjects:
                    runs[name].append(_child(checkout, keys, workers, args.requests))
            medians = {name: {part: statistics.median(r[part] for r in rs) for part in PARTS}
                       for name, rs in runs.items()}
            totals = {name: statistics.median(sum(r.values()) for r in rs)
                      for name, rs in runs.items()}
            print_row(f"{keys} | {workers}",
                      [f"{m['decide']:.1f} / {m['commit']:.1f} / {m['completed']:.1f} = "
                       f"{totals[name]:.1f}" for name, m in medians.items()],
                      [totals[name] for name, _ in subjects], digits=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
