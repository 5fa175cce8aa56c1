"""Benchmark: cache affinity by routing policy, and the gateway's own overhead, in one run.

``python -m loadtest.bench_gateway [--workers 4] [--requests 400] [--json] [--out FILE]``

1. **Affinity by policy.** For each policy, fresh reference workers (fresh caches) and a gateway
   start as child processes on free loopback ports; the same seeded shared-prefix chat workload
   (:mod:`loadtest.workloads`) is replayed through the gateway at a fixed concurrency. Reported:
   hit rate = sum(``x-cache-matched-tokens``) / sum(``x-cache-input-tokens``) over all replies,
   requests per worker (``x-route-worker``), max/mean of those, and errors. The processes are
   stopped before the next policy starts.
2. **Gateway overhead.** One worker with (near) zero simulated costs and a gateway in front of it.
   The same small completion is sent sequentially, alternating direct-to-worker and via-gateway
   in one loop; p50/p99 of each and their differences are the added latency. Then throughput at
   a higher concurrency, direct and via the gateway, in alternating halves.

Everything runs on 127.0.0.1, with bounded request counts, and stops by itself. Markdown goes to
stdout (``--json``: one JSON object instead); ``--out FILE`` also writes the markdown to FILE.
A benchmark, not a test: the numbers depend on the machine; compare them side by side only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from infra.local import LocalCluster
from infra.procs import free_port_block, start_server, stop_processes
from loadtest.harness import (
    AFFINITY_WORKER_ARGS,
    HOST,
    MODEL,
    ZERO_COST_WORKER_ARGS,
    Reply,
    emit,
    percentile,
    post,
    reason_kind,
    replay,
    wait_all_workers_up,
    workload_for,
)

# Re-exported for loadtest.replay, loadtest.chaos_load and loadtest.chaos, which still import
# them from here (loadtest.harness and infra.procs are their home).
__all__ = [
    "AFFINITY_WORKER_ARGS", "HOST", "MODEL", "ZERO_COST_WORKER_ARGS", "Reply", "emit",
    "free_port_block", "percentile", "reason_kind", "replay", "start_server",
    "wait_all_workers_up",
]

POLICIES = (
    "round_robin", "least_load", "consistent_hash", "bounded_hash", "prefix_affinity",
    "cache_aware",
)
OVERHEAD_BODY: dict[str, Any] = {
    "model": MODEL, "prompt": "Say hello to the benchmark.", "max_tokens": 1, "temperature": 0,
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    workers: int = 4
    requests: int = 400
    concurrency: int = 8
    cache_blocks: int = 512
    max_tokens: int = 4
    seed: int = 2024
    latency_pairs: int = 500
    latency_warmup: int = 50
    throughput_requests: int = 2000
    throughput_concurrency: int = 32
    policies: tuple[str, ...] = POLICIES
    gateway_args: tuple[str, ...] = ()  # extra arguments for the gateway (e.g. --procs 2)
    base_port: int = 0  # 0: any free block of workers + 1 consecutive ports


# -- results -------------------------------------------------------------------------------






@dataclass(frozen=True, slots=True)
class AffinityResult:
    policy: str
    requests: int
    errors: int
    hit_rate: float
    per_worker: dict[str, int]
    max_over_mean: float
    gateway_hit_rate: float  # the gateway's own tally (/admin/workers), as a cross-check
    seconds: float
    reasons: dict[str, int]  # x-route-reason kinds
    # Replies the gateway routed as a prefix hit (x-prefix-match-blocks > 0) on which the
    # worker matched nothing: the index believed a prefix the worker no longer held.
    stale_index_hits: int


@dataclass(frozen=True, slots=True)
class Latency:
    count: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class OverheadResult:
    direct: Latency
    gateway: Latency
    added_p50_ms: float
    added_p99_ms: float
    direct_rps: float
    gateway_rps: float
    errors: int
    throughput_requests: int
    throughput_concurrency: int


@dataclass(slots=True)
class BenchResult:
    command: str
    config: BenchConfig
    workload: dict[str, float]
    affinity: list[AffinityResult] = field(default_factory=list)
    overhead: OverheadResult | None = None










def client_session(config: BenchConfig) -> aiohttp.ClientSession:
    """The load generator's pooled client (one per cluster: no keep-alive outlives a server)."""
    connector = aiohttp.TCPConnector(limit=max(64, 2 * config.throughput_concurrency))
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


@contextlib.asynccontextmanager
async def running(cluster: LocalCluster, session: aiohttp.ClientSession) -> AsyncIterator[str]:
    """Start ``cluster`` (workers, then the gateway); yield the gateway URL; stop everything."""
    procs: list[asyncio.subprocess.Process] = []
    logs = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="bench-gateway-"))
    try:
        started = await asyncio.gather(
            *(
                start_server(cmd, url, logs / f"worker{i}.log", procs)
                for i, (cmd, url) in enumerate(
                    zip(cluster.worker_commands(), cluster.worker_urls(), strict=True)
                )
            ),
            return_exceptions=True,  # let every start finish, so the finally stops them all
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        gateway = f"http://{cluster.host}:{cluster.gateway_port}"
        await start_server(cluster.gateway_command(), gateway, logs / "gateway.log", procs)
        await wait_all_workers_up(session, gateway, cluster.workers)
        yield gateway
    finally:
        await stop_processes(procs, grace_s=5.0)
        await asyncio.to_thread(shutil.rmtree, logs, True)


def cluster_for(
    base_port: int, policy: str, workers: int, cache_blocks: int, worker_args: Sequence[str],
    gateway_args: Sequence[str] = (),
) -> LocalCluster:
    """Gateway on ``base_port``, workers on the next ports. Worker ids are ``host:port``, so the
    same ports give every policy the same hash ring (and a rerun with ``--base-port`` too)."""
    return LocalCluster(
        host=HOST,
        gateway_port=base_port,
        worker_base_port=base_port + 1,
        workers=workers,
        policy=policy,
        model=MODEL,
        cache_blocks=cache_blocks,
        worker_args=tuple(worker_args),
        gateway_args=tuple(gateway_args),
    )


# -- load generation -----------------------------------------------------------------------










def latency(seconds: Sequence[float]) -> Latency:
    ms = [s * 1e3 for s in seconds]
    return Latency(len(ms), statistics.median(ms), percentile(ms, 99))


# -- the two sections ----------------------------------------------------------------------


async def bench_policy(
    config: BenchConfig, base_port: int, policy: str, bodies: Sequence[dict[str, Any]]
) -> AffinityResult:
    cluster = cluster_for(
        base_port, policy, config.workers, config.cache_blocks, AFFINITY_WORKER_ARGS,
        config.gateway_args,
    )
    async with client_session(config) as session, running(cluster, session) as gateway:
        started = time.perf_counter()
        replies = await replay(session, gateway + "/v1/chat/completions", bodies,
                               config.concurrency)
        seconds = time.perf_counter() - started
        async with session.get(gateway + "/admin/workers") as response:
            admin = await response.json()
    ok = [r for r in replies if r.status == 200]
    counts = Counter(r.worker for r in ok)
    per_worker = {w["id"]: counts.get(w["id"], 0) for w in admin["workers"]}
    for wid, n in counts.items():  # a worker the gateway no longer lists (should not happen)
        per_worker.setdefault(wid, n)
    mean = sum(per_worker.values()) / len(per_worker) if per_worker else 0.0
    inputs = sum(r.input_tokens for r in ok)
    g_inputs = sum(int(w["input_tokens"]) for w in admin["workers"])
    g_matched = sum(int(w["matched_tokens"]) for w in admin["workers"])
    return AffinityResult(
        policy=policy,
        requests=len(replies),
        errors=len(replies) - len(ok),
        hit_rate=sum(r.matched_tokens for r in ok) / inputs if inputs else 0.0,
        per_worker=dict(sorted(per_worker.items())),
        max_over_mean=max(per_worker.values()) / mean if mean else 0.0,
        gateway_hit_rate=g_matched / g_inputs if g_inputs else 0.0,
        seconds=seconds,
        reasons=dict(Counter(reason_kind(r.reason) for r in ok).most_common()),
        stale_index_hits=sum(1 for r in ok if r.index_blocks > 0 and r.matched_tokens == 0),
    )


async def _throughput(
    session: aiohttp.ClientSession, url: str, count: int, concurrency: int
) -> tuple[float, int]:
    started = time.perf_counter()
    replies = await replay(session, url, [OVERHEAD_BODY] * count, concurrency)
    return time.perf_counter() - started, sum(1 for r in replies if r.status != 200)


async def bench_overhead(config: BenchConfig, base_port: int) -> OverheadResult:
    cluster = cluster_for(
        base_port, "cache_aware", 1, config.cache_blocks, ZERO_COST_WORKER_ARGS
    )
    direct_url = cluster.worker_urls()[0] + "/v1/completions"
    async with client_session(config) as session, running(cluster, session) as gateway:
        gateway_url = gateway + "/v1/completions"
        direct: list[float] = []
        via: list[float] = []
        errors = 0
        for i in range(config.latency_warmup + config.latency_pairs):
            # Alternate which goes first, so neither side always follows the other.
            order = ((direct_url, direct), (gateway_url, via))
            for url, sink in order if i % 2 else order[::-1]:
                reply = await post(session, url, OVERHEAD_BODY)
                errors += reply.status != 200
                if i >= config.latency_warmup:
                    sink.append(reply.seconds)
        half = config.throughput_requests // 2
        elapsed = {direct_url: 0.0, gateway_url: 0.0}
        for url in (direct_url, gateway_url, direct_url, gateway_url):
            seconds, failed = await _throughput(session, url, half, config.throughput_concurrency)
            elapsed[url] += seconds
            errors += failed
    d, g = latency(direct), latency(via)
    return OverheadResult(
        direct=d,
        gateway=g,
        added_p50_ms=g.p50_ms - d.p50_ms,
        added_p99_ms=g.p99_ms - d.p99_ms,
        direct_rps=2 * half / elapsed[direct_url],
        gateway_rps=2 * half / elapsed[gateway_url],
        errors=errors,
        throughput_requests=2 * half,
        throughput_concurrency=config.throughput_concurrency,
    )




async def run_bench(
    config: BenchConfig, command: str, bodies: Sequence[dict[str, Any]],
    workload: dict[str, float],
) -> BenchResult:
    result = BenchResult(command=command, config=config, workload=workload)
    base_port = free_port_block(config.workers + 1, config.base_port)
    for policy in config.policies:
        print(f"[bench] affinity: {policy} (ports {base_port}-{base_port + config.workers}) ...",
              file=sys.stderr, flush=True)
        result.affinity.append(await bench_policy(config, base_port, policy, bodies))
    print("[bench] gateway overhead ...", file=sys.stderr, flush=True)
    result.overhead = await bench_overhead(config, base_port)
    return result


# -- output --------------------------------------------------------------------------------


def to_markdown(result: BenchResult) -> str:
    c, w = result.config, result.workload
    lines = [
        "```",
        result.command,
        "```",
        "",
        f"Workload: {int(w['requests'])} chat requests (seed {c.seed}), {int(w['tenants'])} "
        f"tenants/system prompts ({int(w['system_prompt_chars'])} chars in all), "
        f"{int(w['users'])} users, {w['follow_up_share']:.0%} multi-turn follow-ups; mean prompt "
        f"{w['mean_prompt_chars']:.0f} chars, max_tokens {c.max_tokens}, concurrency "
        f"{c.concurrency}. {c.workers} fresh workers per policy, {c.cache_blocks} cache blocks "
        f"x 16 tokens each, simulated costs `{' '.join(AFFINITY_WORKER_ARGS)}`.",
        "",
        "| policy | hit rate | requests per worker | max/mean | errors |",
        "|---|---:|---|---:|---:|",
    ]
    for a in result.affinity:
        shares = " / ".join(str(n) for n in a.per_worker.values())
        lines.append(f"| {a.policy} | {a.hit_rate:.1%} | {shares} | {a.max_over_mean:.2f} | "
                     f"{a.errors} |")
    lines.append(f"| *bound: one unbounded cache* | {w['ideal_hit_rate']:.1%} | | | |")
    lines += ["", "Routing decisions (`x-route-reason` kinds; stale = routed as a prefix hit but "
              "the worker matched 0 tokens):", ""]
    for a in result.affinity:
        kinds = ", ".join(f"{n} {kind}" for kind, n in a.reasons.items())
        lines.append(f"- {a.policy}: {kinds}; stale {a.stale_index_hits}")
    o = result.overhead
    if o is not None:
        lines += [
            "",
            f"Gateway overhead: 1 worker with zero simulated cost "
            f"(`{' '.join(ZERO_COST_WORKER_ARGS)}`), gateway policy cache_aware, a 1-token "
            f"completion. Latency: {o.direct.count} sequential pairs (after {c.latency_warmup} "
            f"warm-up pairs), direct and via gateway alternating. Throughput: "
            f"{o.throughput_requests} requests per side at concurrency "
            f"{o.throughput_concurrency}, in alternating halves. Errors: {o.errors}.",
            "",
            "| path | p50 ms | p99 ms | requests/s (concurrency "
            f"{o.throughput_concurrency}) |",
            "|---|---:|---:|---:|",
            f"| direct to worker | {o.direct.p50_ms:.2f} | {o.direct.p99_ms:.2f} | "
            f"{o.direct_rps:.0f} |",
            f"| via gateway | {o.gateway.p50_ms:.2f} | {o.gateway.p99_ms:.2f} | "
            f"{o.gateway_rps:.0f} |",
            f"| added by gateway | {o.added_p50_ms:+.2f} | {o.added_p99_ms:+.2f} | "
            f"{o.gateway_rps / o.direct_rps:.2f}x |",
        ]
    return "\n".join(lines) + "\n"


def to_json(result: BenchResult) -> str:
    return json.dumps(asdict(result), indent=2)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_gateway",
        description="Affinity by routing policy and gateway overhead, on loopback, in one run.",
    )
    p.add_argument("--workers", type=int, default=4, help="workers per policy run")
    p.add_argument("--requests", type=int, default=400, help="workload requests per policy")
    p.add_argument("--concurrency", type=int, default=8, help="concurrency of the replay")
    p.add_argument("--cache-blocks", type=int, default=512, help="KV cache blocks per worker")
    p.add_argument("--seed", type=int, default=2024, help="workload seed")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--latency-pairs", type=int, default=500, help="sequential pairs measured")
    p.add_argument("--throughput-requests", type=int, default=2000,
                   help="requests per side in the throughput test")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra argument for the gateway in the affinity runs (repeatable), "
                   "e.g. --gateway-arg=--procs --gateway-arg=2")
    p.add_argument("--base-port", type=int, default=0,
                   help="gateway port; workers take the next ones (default: a free block). Worker "
                   "ids are host:port, so fixing it makes the hash ring reproducible")
    p.add_argument("--json", action="store_true", help="print one JSON object, not markdown")
    p.add_argument("--out", type=Path, help="also write the markdown to this file")
    args = p.parse_args(argv)
    if min(args.workers, args.requests, args.concurrency, args.cache_blocks,
           args.latency_pairs, args.throughput_requests) < 1:
        p.error("counts must be >= 1")
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    if args.base_port and not 1024 <= args.base_port <= 65535 - args.workers:
        p.error("--base-port must leave room for the workers below 65536 (and be >= 1024)")
    return args






def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    config = BenchConfig(
        workers=args.workers,
        requests=args.requests,
        concurrency=args.concurrency,
        cache_blocks=args.cache_blocks,
        seed=args.seed,
        latency_pairs=args.latency_pairs,
        throughput_requests=max(2, args.throughput_requests),
        policies=tuple(p for p in args.policies.split(",") if p),
        base_port=args.base_port,
        gateway_args=tuple(args.gateway_arg),
    )
    command = shlex.join(["python", "-m", "loadtest.bench_gateway", *args_list])
    bodies, workload = workload_for(config.seed, config.requests, config.max_tokens)
    try:
        result = asyncio.run(run_bench(config, command, bodies, workload))
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
        print(f"bench_gateway: {exc}", file=sys.stderr)
        return 1
    emit(to_markdown(result), to_json(result), args.out, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
