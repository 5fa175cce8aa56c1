"""Benchmark: routing policies behind several gateway replicas that share state in Redis.

``python -m loadtest.bench_replicas [--workers 4] [--replicas 2] [--requests 600]
[--concurrency 16] [--json] [--out FILE]``

For each policy (and, for comparison, ``cache_aware`` behind a single replica), in one run:

1. a fresh ``redis-server`` on a free loopback port (no persistence);
2. ``--workers`` fresh reference workers (simulated engine, fresh caches) that register
   themselves in it (``--store redis://... --public-url ...``);
3. ``--replicas`` gateways with ``--store redis://... --policy P`` and no ``--worker``: they find
   the workers in the registry; the run waits until every replica lists all of them healthy;
4. the same seeded shared-prefix chat workload (:mod:`loadtest.workloads`), request ``i`` sent
   to replica ``i % replicas``, at a fixed concurrency;
5. everything stopped (gateways and workers, then Redis) before the next policy starts.

Reported per run: hit rate = sum(``x-cache-matched-tokens``) / sum(``x-cache-input-tokens``);
requests per worker (``x-route-worker``) and their max/mean; uncached (prefill) tokens per worker,
input minus matched, and their max/mean; errors. Two cross-replica figures, derived from the
replies in send order: *follow-ups via the other replica* (a conversation turn whose previous
turn went through another replica: how many reached the worker that served that previous turn)
and *first sight* (the first request of a tenant's system prompt on a replica after another
replica had already routed it: how many the replica's index already knew,
``x-prefix-match-blocks > 0``, how many went to the worker that served the tenant's first
request, and how many the worker matched).

Worker ids are ``host:port``, and every run uses the same ports, so every policy sees the same
hash ring. Loopback only, bounded request counts; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import shlex
import shutil
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
    Reply,
    emit,
    reason_kind,
    replay,
    wait_all_workers_up,
    workload_for,
)

POLICIES = ("cache_aware", "prefix_affinity", "bounded_hash", "round_robin")
REDIS_START_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ReplicaBenchConfig:
    workers: int = 4
    replicas: int = 2
    requests: int = 600
    concurrency: int = 16
    cache_blocks: int = 512
    max_tokens: int = 4
    seed: int = 2024
    heartbeat_s: float = 1.0
    registry_ttl_s: float = 3.0
    policies: tuple[str, ...] = POLICIES
    single_replica: str = "cache_aware"  # also run this policy behind 1 replica ("" = skip)
    base_port: int = 0  # 0: any free block of 1 + replicas + workers consecutive ports


@dataclass(frozen=True, slots=True)
class ReplicaRun:
    policy: str
    replicas: int
    requests: int
    errors: int
    hit_rate: float
    per_worker: dict[str, int]
    max_over_mean: float
    uncached_per_worker: dict[str, int]  # prompt tokens the worker had to prefill
    uncached_max_over_mean: float
    per_replica_hit_rate: list[float]
    gateway_hit_rate: float  # the replicas' own tallies (/admin/workers), summed: a cross-check
    seconds: float
    reasons: dict[str, int]  # x-route-reason kinds
    stale_index_hits: int  # routed as a prefix hit, the worker matched 0 tokens
    cross_followups: int  # follow-ups whose previous turn went through another replica
    cross_followups_same_worker: int
    local_followups: int  # follow-ups whose previous turn went through the same replica
    local_followups_same_worker: int
    first_sights: int  # a replica's first request of a tenant another replica already routed
    first_sights_index_knew: int  # ... with x-prefix-match-blocks > 0
    first_sights_same_worker: int  # ... routed to the worker of the tenant's first request
    first_sights_matched: int  # ... on which the worker matched > 0 tokens
    rebalance_actions: int  # GET /admin/rebalance "actions" (shared), after the run


@dataclass(slots=True)
class ReplicaBenchResult:
    command: str
    config: ReplicaBenchConfig
    workload: dict[str, float]
    runs: list[ReplicaRun] = field(default_factory=list)


# -- processes -----------------------------------------------------------------------------


async def _redis_ping(port: int) -> bool:
    with contextlib.suppress(OSError, TimeoutError):
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 1.0)
        try:
            writer.write(b"PING\r\n")
            await writer.drain()
            return (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"+PONG")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    return False


async def start_redis(
    port: int, log_path: Path, procs: list[asyncio.subprocess.Process]
) -> str:
    """Start a throw-away ``redis-server`` (no RDB, no AOF) on ``port``; return its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    log = await asyncio.to_thread(log_path.open, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
            "--protected-mode", "no",
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
        )
    finally:
        await asyncio.to_thread(log.close)
    procs.append(proc)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while not await _redis_ping(port):
        if proc.returncode is not None or time.monotonic() > deadline:
            tail = (await asyncio.to_thread(log_path.read_text, "utf-8", "replace"))[-2000:]
            raise RuntimeError(f"redis-server on port {port} did not start:\n{tail}")
        await asyncio.sleep(0.05)
    return f"redis://{HOST}:{port}/0"


def ports(base_port: int, replicas: int) -> tuple[int, list[int], int]:
    """(redis port, gateway ports, first worker port) inside the block starting at base_port."""
    return base_port, [base_port + 1 + r for r in range(replicas)], base_port + 1 + replicas


@contextlib.asynccontextmanager
async def running_replicas(
    config: ReplicaBenchConfig, base_port: int, policy: str, replicas: int,
    session: aiohttp.ClientSession,
) -> AsyncIterator[list[str]]:
    """Redis, self-registering workers, then ``replicas`` gateways on the store; yield their
    URLs once each lists every worker healthy; stop everything (Redis last)."""
    redis_procs: list[asyncio.subprocess.Process] = []
    procs: list[asyncio.subprocess.Process] = []
    logs = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="bench-replicas-"))
    redis_port, gateway_ports, worker_port = ports(base_port, replicas)
    try:
        store = await start_redis(redis_port, logs / "redis.log", redis_procs)
        workers = LocalCluster(
            host=HOST, worker_base_port=worker_port, workers=config.workers, policy=policy,
            model=MODEL, cache_blocks=config.cache_blocks,
            worker_args=(*AFFINITY_WORKER_ARGS, "--store", store,
                         "--heartbeat-s", str(config.heartbeat_s),
                         "--registry-ttl-s", str(config.registry_ttl_s)),
            gateway_args=("--store", store),
        )
        started = await asyncio.gather(
            *(
                start_server([*cmd, "--public-url", url], url, logs / f"worker{i}.log", procs)
                for i, (cmd, url) in enumerate(
                    zip(workers.worker_commands(), workers.worker_urls(), strict=True)
                )
            ),
            return_exceptions=True,  # let every start finish, so the finally stops them all
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        gateways: list[str] = []
        for r, port in enumerate(gateway_ports):
            # workers=0: the gateway command without any --worker; it reads the registry.
            gateway = dataclasses.replace(workers, workers=0, gateway_port=port)
            url = f"http://{HOST}:{port}"
            await start_server(gateway.gateway_command(), url, logs / f"gateway{r}.log", procs)
            gateways.append(url)
        await asyncio.gather(
            *(wait_all_workers_up(session, g, config.workers) for g in gateways)
        )
        yield gateways
    finally:
        await stop_processes(procs, grace_s=5.0)  # workers deregister while Redis is up
        await stop_processes(redis_procs, grace_s=5.0)
        await asyncio.to_thread(shutil.rmtree, logs, True)


# -- analysis ------------------------------------------------------------------------------


def _max_over_mean(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 0.0


def _tenant(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"])  # the system prompt: one per tenant


def cross_replica_counts(
    bodies: Sequence[dict[str, Any]], replies: Sequence[Reply], replicas: int
) -> dict[str, int]:
    """Follow-up stickiness within / across replicas, and first sights of a tenant per replica.

    Request ``i`` went to replica ``i % replicas``. A follow-up (more than system + question)
    continues the previous request of the same ``user``; "same worker" means both were answered
    by the same worker. Counted in send order (with concurrency, the previous turn may still be
    in flight: the same for every policy).
    """
    counts = Counter[str]()
    last_of_user: dict[str, int] = {}
    routed_by: dict[str, set[int]] = {}  # tenant -> replicas that have routed it
    first_of: dict[str, int] = {}  # tenant -> its first request
    for i, (body, reply) in enumerate(zip(bodies, replies, strict=True)):
        replica = i % replicas
        user = str(body.get("user", ""))
        prev = last_of_user.get(user)
        last_of_user[user] = i
        ok = reply.status == 200
        if len(body["messages"]) > 2 and prev is not None:
            kind = "local" if prev % replicas == replica else "cross"
            counts[f"{kind}_followups"] += 1
            if ok and replies[prev].status == 200 and reply.worker == replies[prev].worker:
                counts[f"{kind}_followups_same_worker"] += 1
        seen = routed_by.setdefault(_tenant(body), set())
        first = replies[first_of.setdefault(_tenant(body), i)]
        if replica not in seen and seen:
            counts["first_sights"] += 1
            counts["first_sights_index_knew"] += ok and reply.index_blocks > 0
            counts["first_sights_same_worker"] += ok and reply.worker == first.worker
            counts["first_sights_matched"] += ok and reply.matched_tokens > 0
        seen.add(replica)
    return dict(counts)


async def _admin(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as response:
        data: dict[str, Any] = await response.json()
        return data


async def bench_run(
    config: ReplicaBenchConfig, base_port: int, policy: str, replicas: int,
    bodies: Sequence[dict[str, Any]],
) -> ReplicaRun:
    connector = aiohttp.TCPConnector(limit=max(64, 2 * config.concurrency))
    async with (
        aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=60)
        ) as session,
        running_replicas(config, base_port, policy, replicas, session) as gateways,
    ):
        started = time.perf_counter()
        replies = await replay(
            session, [g + "/v1/chat/completions" for g in gateways], bodies, config.concurrency
        )
        seconds = time.perf_counter() - started
        admins = [await _admin(session, g + "/admin/workers") for g in gateways]
        rebalance = await _admin(session, gateways[0] + "/admin/rebalance")
    ok = [r for r in replies if r.status == 200]
    worker_ids = sorted({w["id"] for a in admins for w in a["workers"]} | {r.worker for r in ok})
    counts = Counter(r.worker for r in ok)
    per_worker = {w: counts.get(w, 0) for w in worker_ids}
    uncached = dict.fromkeys(worker_ids, 0)
    for r in ok:
        uncached[r.worker] += r.input_tokens - r.matched_tokens
    inputs = sum(r.input_tokens for r in ok)
    per_replica: list[float] = []
    for k in range(replicas):
        mine = [r for i, r in enumerate(replies) if i % replicas == k and r.status == 200]
        total = sum(r.input_tokens for r in mine)
        per_replica.append(sum(r.matched_tokens for r in mine) / total if total else 0.0)
    g_inputs = sum(int(w["input_tokens"]) for a in admins for w in a["workers"])
    g_matched = sum(int(w["matched_tokens"]) for a in admins for w in a["workers"])
    cross = cross_replica_counts(bodies, replies, replicas)
    return ReplicaRun(
        policy=policy,
        replicas=replicas,
        requests=len(replies),
        errors=len(replies) - len(ok),
        hit_rate=sum(r.matched_tokens for r in ok) / inputs if inputs else 0.0,
        per_worker=per_worker,
        max_over_mean=_max_over_mean(list(per_worker.values())),
        uncached_per_worker=uncached,
        uncached_max_over_mean=_max_over_mean(list(uncached.values())),
        per_replica_hit_rate=per_replica,
        gateway_hit_rate=g_matched / g_inputs if g_inputs else 0.0,
        seconds=seconds,
        reasons=dict(Counter(reason_kind(r.reason) for r in ok).most_common()),
        stale_index_hits=sum(1 for r in ok if r.index_blocks > 0 and r.matched_tokens == 0),
        cross_followups=cross.get("cross_followups", 0),
        cross_followups_same_worker=cross.get("cross_followups_same_worker", 0),
        local_followups=cross.get("local_followups", 0),
        local_followups_same_worker=cross.get("local_followups_same_worker", 0),
        first_sights=cross.get("first_sights", 0),
        first_sights_index_knew=cross.get("first_sights_index_knew", 0),
        first_sights_same_worker=cross.get("first_sights_same_worker", 0),
        first_sights_matched=cross.get("first_sights_matched", 0),
        rebalance_actions=len(rebalance.get("actions", [])),
    )


async def run_bench(
    config: ReplicaBenchConfig, command: str, bodies: Sequence[dict[str, Any]],
    workload: dict[str, float],
) -> ReplicaBenchResult:
    result = ReplicaBenchResult(command=command, config=config, workload=workload)
    size = 1 + config.replicas + config.workers
    base_port = free_port_block(size, config.base_port)
    plan = [(p, config.replicas) for p in config.policies]
    if config.single_replica and config.replicas != 1:
        plan.append((config.single_replica, 1))
    for policy, replicas in plan:
        print(f"[bench] {policy} x {replicas} replica(s) (ports {base_port}-"
              f"{base_port + size - 1}) ...", file=sys.stderr, flush=True)
        run = await bench_run(config, base_port, policy, replicas, bodies)
        print(f"[bench]   hit rate {run.hit_rate:.1%}, max/mean {run.max_over_mean:.2f}, "
              f"{run.errors} errors, {run.seconds:.1f} s", file=sys.stderr, flush=True)
        result.runs.append(run)
    return result


# -- output --------------------------------------------------------------------------------


def _frac(part: int, whole: int) -> str:
    return f"{part}/{whole}" if whole else "-"


def to_markdown(result: ReplicaBenchResult) -> str:
    c, w = result.config, result.workload
    lines = [
        "```",
        result.command,
        "```",
        "",
        f"Workload: {int(w['requests'])} chat requests (seed {c.seed}), {int(w['tenants'])} "
        f"tenants/system prompts, {int(w['users'])} users, {w['follow_up_share']:.0%} multi-turn "
        f"follow-ups; mean prompt {w['mean_prompt_chars']:.0f} chars, max_tokens {c.max_tokens}, "
        f"concurrency {c.concurrency}, request i to replica i mod R. Per run: a fresh "
        f"redis-server, {c.workers} fresh workers registered in it ({c.cache_blocks} cache blocks "
        f"x 16 tokens, `{' '.join(AFFINITY_WORKER_ARGS)}`), R gateways `--store redis://...` "
        "without `--worker`.",
        "",
        "| policy | replicas | hit rate | requests per worker | max/mean | uncached tokens per "
        "worker (k) | max/mean | errors | follow-ups via other replica: same worker | first "
        "sight: index knew / same worker / worker hit |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in result.runs:
        shares = " / ".join(str(n) for n in r.per_worker.values())
        prefill = " / ".join(f"{n / 1000:.0f}" for n in r.uncached_per_worker.values())
        lines.append(
            f"| {r.policy} | {r.replicas} | {r.hit_rate:.1%} | {shares} | "
            f"{r.max_over_mean:.2f} | {prefill} | {r.uncached_max_over_mean:.2f} | {r.errors} | "
            f"{_frac(r.cross_followups_same_worker, r.cross_followups)} | "
            f"{r.first_sights_index_knew} / {r.first_sights_same_worker} / "
            f"{r.first_sights_matched} of {r.first_sights} |"
        )
    lines.append(f"| *bound: one unbounded cache* | | {w['ideal_hit_rate']:.1%} | | | | | | | |")
    lines += ["", "Routing decisions (`x-route-reason` kinds; stale = routed as a prefix hit but "
              "the worker matched 0 tokens; follow-ups through the same replica: same worker):", ""]
    for r in result.runs:
        kinds = ", ".join(f"{n} {kind}" for kind, n in r.reasons.items())
        per_replica = " / ".join(f"{h:.1%}" for h in r.per_replica_hit_rate)
        lines.append(
            f"- {r.policy} x {r.replicas}: {kinds}; stale {r.stale_index_hits}; same-replica "
            f"follow-ups {_frac(r.local_followups_same_worker, r.local_followups)}; hit rate per "
            f"replica {per_replica} (gateways' own tally {r.gateway_hit_rate:.1%}); rebalance "
            f"actions {r.rebalance_actions}; {r.seconds:.1f} s"
        )
    return "\n".join(lines) + "\n"


def to_json(result: ReplicaBenchResult) -> str:
    return json.dumps(asdict(result), indent=2)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_replicas",
        description="Routing policies behind several gateway replicas sharing Redis, on loopback.",
    )
    p.add_argument("--workers", type=int, default=4, help="workers per run")
    p.add_argument("--replicas", type=int, default=2, help="gateway replicas per run")
    p.add_argument("--requests", type=int, default=600, help="workload requests per run")
    p.add_argument("--concurrency", type=int, default=16, help="concurrency of the replay")
    p.add_argument("--cache-blocks", type=int, default=512, help="KV cache blocks per worker")
    p.add_argument("--seed", type=int, default=2024, help="workload seed")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--single-replica", default="cache_aware",
                   help="also run this policy behind one replica, for comparison ('' = skip)")
    p.add_argument("--base-port", type=int, default=0,
                   help="Redis port; gateways and then workers take the next ones (default: a "
                   "free block). Worker ids are host:port, so it pins the hash ring")
    p.add_argument("--json", action="store_true", help="print one JSON object, not markdown")
    p.add_argument("--out", type=Path, help="also write the markdown to this file")
    args = p.parse_args(argv)
    if min(args.workers, args.replicas, args.requests, args.concurrency, args.cache_blocks) < 1:
        p.error("counts must be >= 1")
    known = set(POLICIES) | {"consistent_hash", "least_load"}
    unknown = ({*args.policies.split(","), args.single_replica} - {""}) - known
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(sorted(known))}")
    size = 1 + args.replicas + args.workers
    if args.base_port and not 1024 <= args.base_port <= 65536 - size:
        p.error("--base-port must leave room for Redis, gateways and workers below 65536")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    config = ReplicaBenchConfig(
        workers=args.workers,
        replicas=args.replicas,
        requests=args.requests,
        concurrency=args.concurrency,
        cache_blocks=args.cache_blocks,
        seed=args.seed,
        policies=tuple(p for p in args.policies.split(",") if p),
        single_replica=args.single_replica,
        base_port=args.base_port,
    )
    command = shlex.join(["python", "-m", "loadtest.bench_replicas", *args_list])
    bodies, workload = workload_for(config.seed, config.requests, config.max_tokens)
    try:
        result = asyncio.run(run_bench(config, command, bodies, workload))
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
        print(f"bench_replicas: {exc}", file=sys.stderr)
        return 1
    emit(to_markdown(result), to_json(result), args.out, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
