"""Benchmark: servers of data-parallel engine ranks, routed to rank by rank or as wholes.

``python -m loadtest.bench_dp [--servers 2] [--dp-size 4] [--workload chat] [--requests 1000]
[--cache-blocks 150] [--concurrency 32] [--peers] [--repeat 1] [--json]``

``--servers`` reference workers, each running ``--dp-size`` engine ranks behind its one port
(``python -m worker --data-parallel-size N``: vLLM's data-parallel deployment with one API
server; simulated engines, ``--cache-blocks`` blocks of 16 tokens per rank), replay a workload
of :mod:`loadtest.trace_workloads` closed-loop through, in turn:

- ``ours:ranks``: the gateway told the ranks (``--worker URL#dp-size=N``): every rank is a
  worker of its own, and each request names its rank in ``X-data-parallel-rank``;
- ``ours:servers``: the gateway over the servers as wholes (each server's own balancer, least
  loaded first, picks the rank, as vLLM's does);
- with ``--peers``, each installed peer (sglang-router, smg; cache_aware) over the servers as
  wholes, and the same with ``--dp-aware`` (it asks each server's ``/get_server_info`` for
  ``dp_size`` and names the rank in the body's ``data_parallel_rank``, as SGLang's servers read
  it).

Every rank's cache is flushed between routers. Reported per router: the block hit rate the
servers measured (cached prompt tokens over prompt tokens, from each answer's
``x-cache-*-tokens``), the pooled bound (one cache of every rank's blocks), requests max/mean
over the ranks, p50/p99 latency. A benchmark, not a test: compare routers of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.settings import GatewaySettings
from infra.local import LocalCluster, stop_processes
from infra.procs import free_port_block, start_server
from loadtest.bench_gateway import MODEL, Reply, percentile, replay, wait_all_workers_up
from loadtest.harness import interpreter
from loadtest.peers import PeerUnavailableError, available_peers, running_peer
from loadtest.replay import request_bodies
from loadtest.sim.cluster import pooled_bound
from loadtest.trace_workloads import TRACE_WORKLOADS, workload_trace

HOST = "127.0.0.1"
BLOCK_CHARS = 64  # one trace block: 16 tokens of the workers' 4-characters-per-token tokenizer
START_TIMEOUT_S = 60.0


@dataclass(slots=True)
class RouterResult:
    router: str
    requests: int
    errors: int
    hit_rate: float
    pooled_bound: float
    hit_over_bound: float
    rank_max_over_mean: float  # requests per rank, max over mean
    p50_ms: float
    p99_ms: float
    seconds: float


async def _replay(url: str, bodies: Sequence[dict[str, Any]], concurrency: int) -> list[Reply]:
    """The bodies sent closed-loop through ``url`` (each reply's cached and prompt tokens are
    the worker's ``x-cache-*-tokens``)."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=2 * concurrency)
    ) as session:
        return await replay(session, url + "/v1/completions", bodies, concurrency)


def summarize(router: str, answers: Sequence[Reply], seconds: float, pooled: float,
              per_rank: Sequence[int]) -> RouterResult:
    """``per_rank``: the requests each rank of each server finished during the run."""
    ok = [a for a in answers if a.status == 200]
    tokens = sum(a.input_tokens for a in ok)
    hit = sum(a.matched_tokens for a in ok) / tokens if tokens else 0.0
    mean = sum(per_rank) / len(per_rank) if per_rank else 0.0
    ms = [a.seconds * 1e3 for a in ok] or [0.0]
    return RouterResult(
        router=router, requests=len(answers), errors=len(answers) - len(ok), hit_rate=hit,
        pooled_bound=pooled, hit_over_bound=hit / pooled if pooled else 0.0,
        rank_max_over_mean=max(per_rank, default=0) / mean if mean else 0.0,
        p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99), seconds=seconds,
    )


async def finished_per_rank(urls: Sequence[str]) -> list[int]:
    """Requests finished so far by every rank of every server (``/stats``), server by
    server."""
    out: list[int] = []
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/stats") as response:
                stats = await response.json()
            out += [int(r["requests_finished"]) for r in stats.get("ranks") or [stats]]
    return out


@asynccontextmanager
async def _servers(cluster: LocalCluster, logs: Path) -> AsyncIterator[list[str]]:
    procs: list[asyncio.subprocess.Process] = []
    urls = cluster.worker_urls()
    try:
        await asyncio.gather(*(
            start_server(cmd, url, logs / f"server{i}.log", procs, START_TIMEOUT_S)
            for i, (cmd, url) in enumerate(zip(cluster.worker_commands(), urls, strict=True))))
        yield urls
    finally:
        await stop_processes(procs, grace_s=5.0)


@asynccontextmanager
async def _gateway(cluster: LocalCluster, urls: Sequence[str], fragment: str, healthy: int,
                   logs: Path, name: str) -> AsyncIterator[str]:
    cmd = cluster.gateway_command()
    cmd = [a + fragment if a in urls else a for a in cmd]
    url = f"http://{HOST}:{cluster.gateway_port}"
    procs: list[asyncio.subprocess.Process] = []
    try:
        await start_server(cmd, url, logs / f"{name}.log", procs, START_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            await wait_all_workers_up(session, url, healthy, START_TIMEOUT_S)
        yield url
    finally:
        await stop_processes(procs, grace_s=5.0)


async def _flush(urls: Sequence[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(url + "/admin/flush", json={}) as response:
                response.raise_for_status()


async def run(args: argparse.Namespace) -> list[RouterResult]:
    requests = workload_trace(args.workload, args.requests, args.seed)
    bodies = request_bodies(requests, BLOCK_CHARS, max_tokens=1)
    ranks = args.servers * args.dp_size
    pooled = pooled_bound(requests, ranks * args.cache_blocks)
    base = free_port_block(args.servers + 1)
    cluster = LocalCluster(
        host=HOST, gateway_port=base, worker_base_port=base + 1, workers=args.servers,
        model=MODEL, cache_blocks=args.cache_blocks, policy=args.policy,
        worker_args=("--tokenizer", "chars", "--block-size", "16",
                     "--data-parallel-size", str(args.dp_size),
                     "--max-running", str(args.max_running),
                     "--prefill-us-per-token", str(args.prefill_us_per_token),
                     "--prefill-us-per-cached-token", "1", "--decode-ms-per-token", "0",
                     "--max-model-len", "1000000"),
    )
    routers = [("ours:ranks", f"#dp-size={args.dp_size}"), ("ours:servers", "")]
    peers: list[tuple[str, str, tuple[str, ...]]] = []
    if args.peers:
        installed = available_peers()
        if not installed:
            raise PeerUnavailableError("no peer router is installed (pip install '.[peers]')")
        for binary in installed:
            peers += [(binary, binary, ()), (f"{binary}[dp-aware]", binary, ("--dp-aware",))]
    results: list[RouterResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        logs = Path(tmp)
        async with _servers(cluster, logs) as urls:
            for _ in range(args.repeat):
                for name, fragment in routers:
                    await _flush(urls)
                    healthy = ranks if fragment else args.servers
                    async with _gateway(cluster, urls, fragment, healthy, logs,
                                        name.replace(":", "-")) as url:
                        results.append(await _measure(name, url, urls, bodies, pooled, args))
                for name, binary, extra in peers:
                    await _flush(urls)
                    async with running_peer(binary, urls, logs, extra=extra,
                                            log_name=name) as peer:
                        results.append(await _measure(name, peer.url, urls, bodies, pooled,
                                                      args))
    return results


async def _measure(name: str, url: str, servers: Sequence[str], bodies: Sequence[dict[str, Any]],
                   pooled: float, args: argparse.Namespace) -> RouterResult:
    print(f"[bench_dp] {name} ({len(bodies)} requests) ...", file=sys.stderr, flush=True)
    before = await finished_per_rank(servers)
    started = time.perf_counter()
    answers = await _replay(url, bodies, args.concurrency)
    seconds = time.perf_counter() - started
    after = await finished_per_rank(servers)
    result = summarize(name, answers, seconds, pooled,
                       [b - a for a, b in zip(before, after, strict=True)])
    print(f"[bench_dp] {name}: hit {result.hit_rate:.3f} ({result.hit_over_bound:.3f} of "
          f"bound), rank max/mean {result.rank_max_over_mean:.2f}, p50 {result.p50_ms:.0f} ms,"
          f" p99 {result.p99_ms:.0f} ms, errors {result.errors}", file=sys.stderr, flush=True)
    return result


def medians(results: Sequence[RouterResult]) -> list[dict[str, Any]]:
    rows: dict[str, list[RouterResult]] = {}
    for r in results:
        rows.setdefault(r.router, []).append(r)
    out = []
    for router, runs in rows.items():
        row: dict[str, Any] = {"router": router, "runs": len(runs)}
        for key in ("hit_rate", "hit_over_bound", "rank_max_over_mean", "p50_ms", "p99_ms"):
            row[key] = statistics.median(getattr(r, key) for r in runs)
        row["errors"] = sum(r.errors for r in runs)
        out.append(row)
    return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| router | hit | hit / bound | rank max/mean | p50 ms | p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['router']} | {r['hit_rate']:.3f} | {r['hit_over_bound']:.3f} | "
              f"{r['rank_max_over_mean']:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
              f"{r['errors']} |" for r in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_dp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2, help="worker processes")
    p.add_argument("--dp-size", type=int, default=4, help="engine ranks per server")
    p.add_argument("--workload", choices=TRACE_WORKLOADS, default="chat")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-blocks", type=int, default=150, help="blocks per rank")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-running", type=int, default=8, help="per rank")
    p.add_argument("--prefill-us-per-token", type=float, default=20.0)
    p.add_argument("--policy", default=GatewaySettings().policy, help="the gateway's policy")
    p.add_argument("--peers", action="store_true",
                   help="also the installed peers, with and without --dp-aware")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.servers, args.dp_size, args.requests, args.cache_blocks, args.concurrency,
           args.repeat) < 1:
        parser.error("counts must be >= 1")
    try:
        results = asyncio.run(run(args))
    except (PeerUnavailableError, RuntimeError, OSError) as exc:
        print(f"python -m loadtest.bench_dp: {exc}", file=sys.stderr)
        return 1
    rows = medians(results)
    command = "python -m loadtest.bench_dp " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.json:
        print(json.dumps({"command": command, "python": interpreter(), "medians": rows,
                          "runs": [asdict(r) for r in results]}, indent=1))
    else:
        print(f"`{command}`\n\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
