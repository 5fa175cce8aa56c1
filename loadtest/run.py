"""Headless live load test: cluster(s) up, locust against the gateway, report out.

``python -m loadtest run --workload W --policy P --workers N --duration S [--users U]
[--gateway URL] [--out DIR]``

For each policy (``--policy all`` or a comma list runs several, one after another), fresh
reference workers and a gateway start on free loopback ports (:class:`infra.local.LocalCluster`,
as :mod:`loadtest.bench_gateway` starts them: the same ports for every policy, so the same ring),
then ``locust -f loadtest/locustfile.py --headless`` runs for ``S`` seconds as a child process
(locust monkey-patches the process with gevent, so it gets its own), writing one JSON line per
request. With ``--gateway URL`` nothing is started: locust targets that gateway, and the policy
is the one it reports at ``/admin/workers``.

The report (``--out``, default ``loadtest/out/run-<workload>``): ``report.json``, ``report.md``,
``hit_rate.png`` (hit rate over time per policy), ``worker_load.png`` (requests per worker),
plus locust's own CSV/HTML/log per policy and the raw samples. Exit status 0 when every policy
produced samples, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.routing.policies import POLICY_NAMES
from infra.procs import free_port_block
from loadtest.bench_gateway import BenchConfig, client_session, cluster_for, running
from loadtest.report import PolicyResult, RunReport, summarize, write_report
from loadtest.samples import read_samples
from loadtest.workloads import WORKLOADS

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
DEFAULT_OUT = Path("loadtest") / "out"
# Simulated worker costs of a live run: the reference worker's defaults (200 us per uncached
# prompt token, 5 us per cached one, 5 ms per output token), so a cache hit visibly shortens
# TTFT. Change them with --worker-arg.
DEFAULT_WORKER_ARGS: tuple[str, ...] = ()
_LOCUST_GRACE_S = 60.0  # on top of --duration: start-up, stop timeout, the summary


@dataclass(frozen=True, slots=True)
class RunConfig:
    workload: str
    policies: tuple[str, ...]
    workers: int
    duration_s: float
    users: int
    spawn_rate: float
    cache_blocks: int
    max_tokens: int
    seed: int
    think_time: float
    out: Path
    gateway: str = ""
    base_port: int = 0
    worker_args: tuple[str, ...] = DEFAULT_WORKER_ARGS
    locust_args: tuple[str, ...] = ()
    bucket_s: float = 2.0
    plots: bool = True

    def summary(self) -> dict[str, Any]:
        return {
            "workload": self.workload, "policies": list(self.policies), "workers": self.workers,
            "duration_s": self.duration_s, "users": self.users, "spawn_rate": self.spawn_rate,
            "cache_blocks": self.cache_blocks, "max_tokens": self.max_tokens, "seed": self.seed,
            "think_time": self.think_time, "gateway": self.gateway or None,
            "worker_args": list(self.worker_args), "locust_args": list(self.locust_args),
        }


def locust_command(config: RunConfig, host: str, policy: str) -> list[str]:
    prefix = config.out / policy
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", host,
        "--users", str(config.users), "--spawn-rate", str(config.spawn_rate),
        "--run-time", f"{max(1, round(config.duration_s))}s", "--stop-timeout", "10",
        "--only-summary", "--csv", str(prefix / "locust"), "--html", str(prefix / "locust.html"),
        "--workload", config.workload, "--seed", str(config.seed),
        "--max-tokens", str(config.max_tokens), "--think-time", str(config.think_time),
        "--samples-file", str(prefix / "samples.jsonl"),
        *config.locust_args,
    ]


async def run_locust(config: RunConfig, host: str, policy: str) -> int:
    """Run locust headless against ``host``; its output goes to ``<out>/<policy>/locust.log``."""
    prefix = config.out / policy
    prefix.mkdir(parents=True, exist_ok=True)
    log_path = prefix / "locust.log"
    cmd = locust_command(config, host, policy)
    log = await asyncio.to_thread(log_path.open, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
        )
    finally:
        await asyncio.to_thread(log.close)
    try:
        return await asyncio.wait_for(proc.wait(), config.duration_s + _LOCUST_GRACE_S)
    except TimeoutError:
        print(f"[loadtest] locust overran its time for {policy}; stopping it", file=sys.stderr)
        return await _stop(proc)
    finally:
        if proc.returncode is None:
            await _stop(proc)


async def _stop(proc: asyncio.subprocess.Process) -> int:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), 10.0)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        return await proc.wait()


def _complain(config: RunConfig, policy: str, code: int) -> None:
    log_path = config.out / policy / "locust.log"
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    tail = text[-1500:]
    print(f"[loadtest] locust exited with {code} for {policy} ({log_path}):\n{tail}",
          file=sys.stderr)


async def admin_workers(session: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with session.get(gateway.rstrip("/") + "/admin/workers") as response:
        response.raise_for_status()
        data: dict[str, Any] = await response.json()
    return data


def _gateway_hit_rate(admin: dict[str, Any]) -> float | None:
    workers = admin.get("workers", [])
    inputs = sum(int(w.get("input_tokens", 0)) for w in workers)
    matched = sum(int(w.get("matched_tokens", 0)) for w in workers)
    return matched / inputs if inputs else None


def _collect(config: RunConfig, policy: str, started: float, ended: float,
             admin: dict[str, Any]) -> PolicyResult:
    path = config.out / policy / "samples.jsonl"
    samples = read_samples(path.read_text(encoding="utf-8").splitlines()) if path.exists() else []
    workers = [str(w["id"]) for w in admin.get("workers", [])]
    duration = min(config.duration_s, ended - started) if ended > started else config.duration_s
    return summarize(policy, config.workload, samples, duration, workers, config.bucket_s,
                     _gateway_hit_rate(admin))


async def run_policy(config: RunConfig, base_port: int, policy: str) -> PolicyResult:
    """One fresh cluster with ``policy``, one locust run against it."""
    cluster = cluster_for(base_port, policy, config.workers, config.cache_blocks,
                          config.worker_args)
    bench = BenchConfig(workers=config.workers)
    async with client_session(bench) as session, running(cluster, session) as gateway:
        started = time.monotonic()
        code = await run_locust(config, gateway, policy)
        ended = time.monotonic()
        admin = await admin_workers(session, gateway)
    if code not in (0, 1):  # 1: locust saw failed requests, which the report counts
        _complain(config, policy, code)
    return _collect(config, policy, started, ended, admin)


async def run_against(config: RunConfig) -> PolicyResult:
    """One locust run against an already running gateway (``--gateway``)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        before = await admin_workers(session, config.gateway)
        policy = str(before.get("policy", "gateway"))
        started = time.monotonic()
        code = await run_locust(config, config.gateway, policy)
        ended = time.monotonic()
        admin = await admin_workers(session, config.gateway)
    if code not in (0, 1):
        _complain(config, policy, code)
    return _collect(config, policy, started, ended, admin)


async def run_all(config: RunConfig, command: str) -> RunReport:
    report = RunReport(command=command, config=config.summary())
    if config.gateway:
        print(f"[loadtest] {config.workload} against {config.gateway} ...", file=sys.stderr)
        report.results.append(await run_against(config))
        return report
    base_port = free_port_block(config.workers + 1, config.base_port)
    for policy in config.policies:
        print(f"[loadtest] {config.workload} / {policy}: {config.workers} workers, ports "
              f"{base_port}-{base_port + config.workers}, {config.users} users, "
              f"{config.duration_s:g} s ...", file=sys.stderr, flush=True)
        result = await run_policy(config, base_port, policy)
        print(f"[loadtest] {policy}: hit rate {result.hit_rate:.1%}, TTFT p50 "
              f"{result.ttft_p50_ms:.0f} ms, {result.rps:.1f} req/s, {result.errors} errors",
              file=sys.stderr, flush=True)
        report.results.append(result)
    return report


def parse_policies(text: str) -> tuple[str, ...]:
    if text == "all":
        return tuple(POLICY_NAMES)
    policies = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown or not policies:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)} "
                         "or 'all'")
    return policies


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest run",
        description="Live load test: fresh workers + gateway per policy, locust headless "
        "against it, a report with hit rate, TTFT, requests/s, per-worker share and plots.",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    p.add_argument("--policy", default="cache_aware",
                   help="routing policy, a comma list, or 'all' (default cache_aware)")
    p.add_argument("--workers", type=int, default=4, help="workers per cluster")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per policy")
    p.add_argument("--users", type=int, default=16, help="concurrent locust users")
    p.add_argument("--spawn-rate", type=float, default=0.0,
                   help="users started per second (default: all at once)")
    p.add_argument("--cache-blocks", type=int, default=512,
                   help="KV cache blocks (16 tokens each) per worker")
    p.add_argument("--max-tokens", type=int, default=8, help="decode budget per request")
    p.add_argument("--seed", type=int, default=2024, help="workload seed")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean seconds between a user's requests (0: closed loop)")
    p.add_argument("--gateway", default="",
                   help="target this running gateway instead of starting clusters")
    p.add_argument("--out", type=Path, help="report directory (default loadtest/out/run-W)")
    p.add_argument("--base-port", type=int, default=0,
                   help="gateway port; workers take the next ones (default: a free block)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for every worker, e.g. --worker-arg=--max-running=4 "
                   "(repeatable)")
    p.add_argument("--locust-arg", action="append", default=[],
                   help="extra argument for locust, e.g. --locust-arg=--block-chars=512 "
                   "(repeatable)")
    p.add_argument("--bucket", type=float, default=2.0, help="seconds per timeline point")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def config_from_args(argv: Sequence[str]) -> RunConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        policies = parse_policies(args.policy)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.workers, args.users, args.cache_blocks, args.max_tokens) < 1:
        parser.error("--workers, --users, --cache-blocks and --max-tokens must be >= 1")
    if not 0 < args.duration <= 3600:
        parser.error("--duration must be in (0, 3600] seconds")
    if args.gateway and len(policies) > 1:
        parser.error("--gateway runs against one gateway: its policy is the one it has")
    return RunConfig(
        workload=args.workload,
        policies=policies,
        workers=args.workers,
        duration_s=args.duration,
        users=args.users,
        spawn_rate=args.spawn_rate if args.spawn_rate > 0 else float(args.users),
        cache_blocks=args.cache_blocks,
        max_tokens=args.max_tokens,
        seed=args.seed,
        think_time=max(0.0, args.think_time),
        out=args.out or DEFAULT_OUT / f"run-{args.workload}",
        gateway=args.gateway.rstrip("/"),
        base_port=args.base_port,
        worker_args=tuple(args.worker_arg),
        locust_args=tuple(args.locust_arg),
        bucket_s=args.bucket,
        plots=not args.no_plots,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    config = config_from_args(args_list)
    command = shlex.join(["python", "-m", "loadtest", "run", *args_list])
    try:
        report = asyncio.run(run_all(config, command))
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
        print(f"python -m loadtest run: {exc}", file=sys.stderr)
        return 1
    paths = write_report(report, config.out, plots=config.plots)
    print((config.out / "report.md").read_text(encoding="utf-8"), end="")
    print(f"[loadtest] report: {paths['markdown']} ({', '.join(p.name for p in paths.values())})",
          file=sys.stderr)
    return 0 if all(r.ok for r in report.results) else 1
