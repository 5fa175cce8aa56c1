"""Cluster simulator CLI: replay a trace through the gateway's routing onto simulated workers.

``python -m loadtest.simulate --trace PATH --workers N --cache-blocks C --policy P [--json]``

* ``--trace``: a Mooncake jsonl trace (default: the bundled conversation trace);
  ``--synthetic N`` generates a multi-tenant chat trace of N requests instead, ``--rag N`` a
  RAG trace (:mod:`loadtest.rag_trace`).
* ``--policy``: any gateway policy (``gateway.routing.policies.POLICY_NAMES``), ``oracle`` (the
  full-knowledge reference) or ``all`` (every one of them side by side, as a markdown table).
* ``--ring-seeds S [S ...]``: run each policy once per ring seed (another set of worker names,
  so another ring: :func:`loadtest.sim.cluster.worker_ids`) and add a summary, mean (min-max)
  per metric. Single runs move by more than the differences between good settings.
* Mode: ``sequential`` (default; trace order, ``--concurrency`` in flight, 64 by default: how
  peers replay this trace) or ``replay`` (arrivals at ``timestamp / --speedup``; giving
  ``--speedup`` selects it). See :mod:`loadtest.sim.cluster` for the model and its costs.
* Live timing: ``--route-delay-ms`` / ``--relay-delay-ms`` (where a live request spends its time
  outside the worker) and ``--rebalance-interval-s`` (the gateway's rebalancer; 0: off).

Prints markdown (``--json``: one JSON object; with ``all`` or several seeds,
``{"results": [...]}``, plus ``"summary"`` over the seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gateway.settings import GatewaySettings
from loadtest.rag_trace import rag_spec, rag_trace
from loadtest.sim.cluster import DEFAULT_COSTS, Mode, SimConfig, pooled_bound, simulate
from loadtest.sim.report import (
    Metrics,
    markdown_one,
    markdown_seed_summary,
    markdown_table,
    metrics,
    seed_summary,
)
from loadtest.sim.routers import policy_names
from loadtest.traces import (
    DEFAULT_TRACE_DIR,
    SyntheticSpec,
    TraceRequest,
    read_mooncake,
    synthetic_trace,
)
from worker.engines.sim import SimCosts

DEFAULT_TRACE = DEFAULT_TRACE_DIR / "conversation_trace.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.simulate",
        description="Discrete-event cluster simulation with the gateway's own routing code.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help=f"Mooncake jsonl trace (default {DEFAULT_TRACE})")
    src.add_argument("--synthetic", type=int, metavar="N",
                     help="generate a synthetic multi-tenant chat trace of N requests")
    src.add_argument("--rag", type=int, metavar="N",
                     help="generate a synthetic RAG trace of N requests (loadtest.rag_trace)")
    p.add_argument("--rag-option", action="append", default=[], metavar="NAME=VALUE",
                   help="rag: set a field of loadtest.rag_trace.RagSpec (repeatable)")
    p.add_argument("--tenants", type=int, default=256, help="synthetic: tenants (system prompts)")
    p.add_argument("--rate", type=float, default=20.0, help="synthetic: arrivals per second")
    p.add_argument("--seed", type=int, default=0, help="synthetic: seed")
    p.add_argument("--limit", type=int, metavar="K", help="only the first K requests")
    p.add_argument("--workers", type=int, default=16, help="simulated workers (default 16)")
    p.add_argument("--cache-blocks", type=int, default=500,
                   help="KV cache blocks per worker, one block = one trace block (default 500)")
    choices = (*policy_names(), "all")
    p.add_argument("--policy", default=GatewaySettings().policy, choices=choices,
                   help="routing policy, 'oracle', or 'all' (default: the gateway's default)")
    p.add_argument("--mode", choices=("sequential", "replay"),
                   help="sequential (default) or replay by timestamp (default if --speedup)")
    p.add_argument("--concurrency", type=int, metavar="M",
                   help="at most M requests in flight (default 64 sequential, unbounded replay)")
    p.add_argument("--speedup", type=float, help="replay: divide timestamps by X (default 1)")
    p.add_argument("--max-running", type=int, default=32,
                   help="admitted requests per worker; more wait in its FIFO queue (default 32)")
    p.add_argument("--prefill-us-per-token", type=float, default=DEFAULT_COSTS.prefill_us_per_token)
    p.add_argument("--cached-us-per-token", type=float,
                   default=DEFAULT_COSTS.prefill_us_per_cached_token)
    p.add_argument("--decode-ms-per-token", type=float, default=DEFAULT_COSTS.decode_ms_per_token)
    p.add_argument("--parallel-prefill", action="store_true",
                   help="prefills on one worker do not wait for each other")
    p.add_argument("--prefill-shared", action="store_true",
                   help="prefills on one worker share its compute, each at 1/n of its speed "
                   "while n are in prefill (the reference worker's --prefill-shared)")
    p.add_argument("--load-factor", type=float, help="bounded-load factor c (gateway default)")
    p.add_argument("--policy-option", action="append", default=[], metavar="NAME=VALUE",
                   help="set a field of gateway.routing.policies.PolicyOptions (repeatable)")
    p.add_argument("--index-ttl-s", type=float, help="prefix index TTL (gateway default)")
    p.add_argument("--index-capacity", type=int, help="prefix index entries (gateway default)")
    p.add_argument("--rebalance-interval-s", type=float,
                   help="the gateway's rebalancer every S simulated seconds (gateway default; "
                   "0: off)")
    p.add_argument("--route-delay-ms", type=float, default=0.0,
                   help="live timing: a request's wait from the client's send to the routing "
                   "decision (default 0)")
    p.add_argument("--streaming", action="store_true",
                   help="streamed replies: the gateway sees each first token (its queued "
                   "prefill ends there, not at the end)")
    p.add_argument("--relay-delay-ms", type=float, default=0.0,
                   help="live timing: from the worker's last token to the gateway settling the "
                   "request (default 0)")
    p.add_argument("--ring-seeds", type=int, nargs="+", default=[0], metavar="S",
                   help="run once per ring seed (worker names) and summarise (default 0)")
    p.add_argument("--loss-breakdown", action="store_true",
                   help="per request, where the blocks one pooled LRU would reuse went: routed "
                   "to a worker holding less than another, or evicted fleet-wide")
    p.add_argument("--jobs", type=int, default=1, help="with --policy all: parallel processes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def config_from_args(args: argparse.Namespace, policy: str) -> SimConfig:
    mode: Mode
    if args.mode is not None:
        mode = args.mode
    else:
        mode = "replay" if args.speedup is not None else "sequential"
    concurrency = args.concurrency
    if concurrency is None and mode == "sequential":
        concurrency = 64
    costs = SimCosts(
        prefill_us_per_token=args.prefill_us_per_token,
        prefill_us_per_cached_token=args.cached_us_per_token,
        decode_ms_per_token=args.decode_ms_per_token,
        prefill_shared=args.prefill_shared,
    )
    config = SimConfig(
        workers=args.workers, cache_blocks=args.cache_blocks, policy=policy, mode=mode,
        concurrency=concurrency, speedup=args.speedup or 1.0, max_running=args.max_running,
        costs=costs, serial_prefill=not args.parallel_prefill,
        route_delay_s=args.route_delay_ms / 1e3, relay_delay_s=args.relay_delay_ms / 1e3,
        streaming=args.streaming, loss_breakdown=args.loss_breakdown,
    )
    if args.rebalance_interval_s is not None:
        config = dataclasses.replace(config, rebalance_interval_s=args.rebalance_interval_s)
    if args.load_factor is not None:
        options = dataclasses.replace(config.policy_options, load_factor=args.load_factor)
        config = dataclasses.replace(config, policy_options=options)
    for item in args.policy_option:
        name, _, raw = item.partition("=")
        current = getattr(config.policy_options, name)  # AttributeError names a bad field
        options = dataclasses.replace(config.policy_options, **{name: type(current)(raw)})
        config = dataclasses.replace(config, policy_options=options)
    if args.index_ttl_s is not None:
        config = dataclasses.replace(config, index_ttl_s=args.index_ttl_s)
    if args.index_capacity is not None:
        config = dataclasses.replace(config, index_capacity=args.index_capacity)
    return config


def _run_one(requests: Sequence[TraceRequest], config: SimConfig, pooled: float) -> Metrics:
    return metrics(simulate(requests, config), pooled)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.synthetic is not None:
        spec = SyntheticSpec(requests=args.synthetic, tenants=args.tenants,
                             rate_per_s=args.rate, seed=args.seed)
        requests = synthetic_trace(spec)
        source = f"synthetic({args.synthetic}, tenants={args.tenants}, seed={args.seed})"
    elif args.rag is not None:
        try:
            rag = rag_trace(rag_spec(args.rag, args.seed, args.rate, args.rag_option))
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
        requests = list(rag.requests)
        source = f"rag({', '.join([str(args.rag), f'seed={args.seed}', *args.rag_option])})"
    else:
        path = args.trace or DEFAULT_TRACE
        requests = read_mooncake(path, args.limit)
        source = str(path)
    if args.limit is not None:
        requests = requests[: args.limit]
    policies = policy_names() if args.policy == "all" else (args.policy,)
    try:
        configs = [
            dataclasses.replace(config_from_args(args, name), ring_seed=seed)
            for name in policies for seed in args.ring_seeds
        ]
    except ValueError as exc:
        parser.error(str(exc))
    pooled = pooled_bound(requests, args.workers * args.cache_blocks)
    many = args.policy == "all" or len(args.ring_seeds) > 1
    if args.jobs > 1 and len(configs) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(_run_one, requests, cfg, pooled) for cfg in configs]
            rows = [f.result() for f in futures]
    else:
        rows = [_run_one(requests, cfg, pooled) for cfg in configs]
    for row in rows:
        row["trace"] = source
    summary = seed_summary(rows) if len(args.ring_seeds) > 1 else []
    if args.json:
        out: object = {"results": rows} if many else rows[0]
        if summary:
            out = {"results": rows, "summary": summary}
        print(json.dumps(out, indent=2))
    elif many:
        print(f"trace: {source}\n")
        print(markdown_table(rows))
        if summary:
            print(f"\nover ring seeds {' '.join(map(str, args.ring_seeds))}:\n")
            print(markdown_seed_summary(summary))
    else:
        print(markdown_one(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
