"""The gateway's memory under a flood of large request bodies, by body budget.

``python -m loadtest.body_flood [--clients N] [--mib M] [--budget-mib B ...]`` starts, for each
budget (``--max-held-body-bytes``, 0: none), one reference worker and the gateway in front of
it, sends ``N`` chat requests of ``M`` MiB each (one long message of its own per client, so
that nothing is remembered from one to the next) all at once, streamed answers of 50 tokens
paced 20 ms apart, and prints the gateway's peak resident memory (``VmHWM``), the answers by
status and the wall time. A measurement, not a test: what the budget bounds is the bodies held,
and the gateway's memory follows them (the decoded body beside its bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from infra.procs import HOST, free_port_block, start_server, stop_processes

MODEL = "flood-model"
_LINE = "the quick brown fox jumps over the lazy dog and keeps on running\n"


@dataclass(frozen=True)
class FloodResult:
    budget_mib: int
    peak_rss_mib: int
    answers: dict[str, int]
    seconds: float


def bodies(clients: int, mib: int) -> list[bytes]:
    """One chat body of about ``mib`` MiB per client, each with a text of its own."""
    text = _LINE * (mib * 1024 * 1024 // len(_LINE))
    return [json.dumps({"model": MODEL, "max_tokens": 50, "stream": True, "messages": [
        {"role": "user", "content": f"client {i}\n{text}"}]}).encode() for i in range(clients)]


def peak_rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) >> 10
    return 0


async def flood(budget_mib: int, clients: int, mib: int, logs: Path) -> FloodResult:
    base = free_port_block(2)
    worker, gateway = f"http://{HOST}:{base}", f"http://{HOST}:{base + 1}"
    tokens = mib * 1024 * 1024  # at most one token a character: every prompt fits the worker
    procs: list[asyncio.subprocess.Process] = []
    try:
        await start_server(
            [sys.executable, "-m", "worker", "--host", HOST, "--port", str(base), "--model",
             MODEL, "--max-model-len", str(tokens + 10_000), "--cache-blocks",
             str(tokens // 16 + 1024), "--prefill-us-per-token", "0",
             "--prefill-us-per-cached-token", "0", "--decode-ms-per-token", "20"],
            worker, logs / f"worker-{budget_mib}.log", procs, timeout_s=120.0)
        await start_server(
            [sys.executable, "-m", "gateway", "--port", str(base + 1), "--worker", worker,
             "--access-log", "off", "--max-body-bytes", str((mib + 1) << 20),
             "--max-held-body-bytes", str(budget_mib << 20)],
            gateway, logs / f"gateway-{budget_mib}.log", procs, timeout_s=120.0)
        answers: collections.Counter[str] = collections.Counter()
        timeout = aiohttp.ClientTimeout(total=1200)
        async with aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one(body: bytes) -> None:
                try:
                    async with session.post(gateway + "/v1/chat/completions", data=body,
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        answers[str(r.status)] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    answers[type(exc).__name__] += 1

            sent = bodies(clients, mib)
            started = time.monotonic()
            await asyncio.gather(*(one(body) for body in sent))
            seconds = time.monotonic() - started
        return FloodResult(budget_mib, peak_rss_mib(procs[1].pid), dict(answers), seconds)
    finally:
        await stop_processes(procs)


async def main_async(budgets: Sequence[int], clients: int, mib: int) -> list[FloodResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="body-flood-") as logs:
        for budget in budgets:
            results.append(await flood(budget, clients, mib, Path(logs)))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--mib", type=int, default=4, help="each body's size")
    parser.add_argument("--budget-mib", type=int, action="append",
                        help="--max-held-body-bytes in MiB (repeatable; 0: none)")
    args = parser.parse_args(argv)
    budgets = args.budget_mib or [0, 256]
    print(f"{args.clients} clients at once, {args.mib} MiB bodies each:\n")
    print("| budget | gateway peak RSS | answers | seconds |\n|---|---:|---|---:|")
    for r in asyncio.run(main_async(budgets, args.clients, args.mib)):
        budget = f"{r.budget_mib} MiB" if r.budget_mib else "none"
        answers = ", ".join(f"{n} x {s}" for s, n in sorted(r.answers.items()))
        print(f"| {budget} | {r.peak_rss_mib} MiB | {answers} | {r.seconds:.1f} |")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
