"""Stored-response conversations through each router: does a next turn by
``previous_response_id`` reach the server that stored the last one?

``python -m loadtest.bench_stored [--workers 4] [--conversations 48] [--turns 6]
[--concurrency 8] [--routers ours,sglang-router,smg] [--json]``

Reference workers that store their Responses answers as vLLM's response store does; in front of
the same workers, in the same run, our gateway and (installed with the ``peers`` extra)
sglang-router and smg. Each conversation opens with its own instructions and question, then
sends ``turns - 1`` next turns that carry only ``previous_response_id`` and a new question, as
the OpenAI SDK's stateful conversations do; a turn that fails ends its conversation (its id is
what the next one would name). Per router: the share of next turns answered, the conversations
that finished, what the failures were, the share of the answered turns' prompt tokens the
worker served from its prefix cache, and latency. Then, for each router, a ``GET
/v1/responses/{id}`` of every conversation's last answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from infra.procs import free_port_block, start_server, stop_processes
from loadtest.harness import MODEL, emit, percentile
from loadtest.peers import PEERS, PeerUnavailableError, gateway_log_args, running_peer
from loadtest.workloads import system_prompt, words

HOST = "127.0.0.1"
DEFAULT_ROUTERS = ("ours", *PEERS)


@dataclass(frozen=True, slots=True)
class StoredConfig:
    workers: int = 4
    conversations: int = 48
    turns: int = 6
    concurrency: int = 8
    routers: tuple[str, ...] = DEFAULT_ROUTERS
    seed: int = 1


@dataclass(slots=True)
class RouterResult:
    name: str
    next_turns: int = 0  # next turns sent
    answered: int = 0  # of which answered 200
    finished: int = 0  # conversations whose every turn was answered
    failures: dict[str, int] = field(default_factory=dict)  # "HTTP 404 code" -> count
    input_tokens: int = 0  # over the answered next turns
    cached_tokens: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    retrieved: int = 0  # last answers found by GET /v1/responses/{id}
    last_ids: int = 0


def _opening(config: StoredConfig, i: int) -> dict[str, Any]:
    rng = random.Random(f"{config.seed}:open:{i}")
    return {"model": MODEL, "instructions": system_prompt(config.seed, i, (1500, 2500)),
            "input": words(rng, 30) + "?", "max_output_tokens": 8}


def _next(config: StoredConfig, i: int, turn: int, previous: str) -> dict[str, Any]:
    rng = random.Random(f"{config.seed}:turn:{i}:{turn}")
    return {"model": MODEL, "previous_response_id": previous,
            "instructions": system_prompt(config.seed, i, (1500, 2500)),
            "input": words(rng, 12) + "?", "max_output_tokens": 8}


async def _post(http: aiohttp.ClientSession, url: str,
                body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    started = time.perf_counter()
    async with http.post(url + "/v1/responses", json=body) as r:
        payload = await r.json(content_type=None)
    return r.status, payload if isinstance(payload, dict) else {}, time.perf_counter() - started


async def _conversation(http: aiohttp.ClientSession, url: str, config: StoredConfig, i: int,
                        result: RouterResult, last_ids: list[str]) -> None:
    status, payload, _ = await _post(http, url, _opening(config, i))
    if status != 200:
        result.failures[f"opening HTTP {status}"] = (
            result.failures.get(f"opening HTTP {status}", 0) + 1)
        return
    previous = str(payload["id"])
    for turn in range(1, config.turns):
        result.next_turns += 1
        status, payload, elapsed = await _post(http, url, _next(config, i, turn, previous))
        if status != 200:
            error = payload.get("error") or {}
            key = f"HTTP {status} {error.get('code') or error.get('type') or ''}".strip()
            result.failures[key] = result.failures.get(key, 0) + 1
            return
        result.answered += 1
        result.latencies_ms.append(elapsed * 1e3)
        usage = payload.get("usage") or {}
        result.input_tokens += int(usage.get("input_tokens") or 0)
        result.cached_tokens += int(
            (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        previous = str(payload["id"])
    result.finished += 1
    last_ids.append(previous)


async def run_router(http: aiohttp.ClientSession, name: str, url: str,
                      config: StoredConfig) -> RouterResult:
    result = RouterResult(name)
    last_ids: list[str] = []
    gate = asyncio.Semaphore(config.concurrency)

    async def one(i: int) -> None:
        async with gate:
            await _conversation(http, url, config, i, result, last_ids)

    await asyncio.gather(*(one(i) for i in range(config.conversations)))
    result.last_ids = len(last_ids)
    for rid in last_ids:
        async with http.get(f"{url}/v1/responses/{rid}") as r:
            await r.read()
            result.retrieved += r.status == 200
    return result


@contextlib.asynccontextmanager
async def _routers(config: StoredConfig, skipped: dict[str, str]) -> AsyncIterator[
        list[tuple[str, str]]]:
    base = free_port_block(config.workers + 1)
    worker_urls = [f"http://{HOST}:{base + i}" for i in range(config.workers)]
    procs: list[asyncio.subprocess.Process] = []
    logs = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="bench-stored-"))
    try:
        async with contextlib.AsyncExitStack() as stack:
            for i, url in enumerate(worker_urls):
                await start_server(
                    [sys.executable, "-m", "worker", "--host", HOST, "--port", str(base + i),
                     "--model", MODEL, "--prefill-us-per-token", "20",
                     "--decode-ms-per-token", "0.5"], url, logs / f"worker{i}.log", procs)
            routers: list[tuple[str, str]] = []
            if "ours" in config.routers:
                port = base + config.workers
                url = f"http://{HOST}:{port}"
                await start_server(
                    [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(port),
                     "--policy", "cache_aware", *gateway_log_args(False),
                     *(a for w in worker_urls for a in ("--worker", w))],
                    url, logs / "ours.log", procs)
                routers.append(("ours", url))
            for name in config.routers:
                if name not in PEERS:
                    continue
                try:
                    peer = await stack.enter_async_context(
                        running_peer(name, worker_urls, logs, host=HOST))
                except PeerUnavailableError as exc:
                    skipped[name] = str(exc).splitlines()[0]
                    continue
                routers.append((name, peer.url))
            yield routers
    finally:
        await stop_processes(procs, grace_s=5.0)
        await asyncio.to_thread(shutil.rmtree, logs, True)


async def run(config: StoredConfig) -> tuple[list[RouterResult], dict[str, str]]:
    skipped: dict[str, str] = {}
    async with _routers(config, skipped) as routers, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=60)) as http:
        for _, url in routers:  # until each routes (peers add their workers in the background)
            for _ in range(150):
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    status, _, _ = await _post(http, url, {"model": MODEL, "input": "ready?",
                                                           "max_output_tokens": 1})
                    if status == 200:
                        break
                await asyncio.sleep(0.2)
        results = []
        for name, url in routers:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            results.append(await run_router(http, name, url, config))
    return results, skipped


def to_markdown(config: StoredConfig, command: str, results: Sequence[RouterResult],
                skipped: dict[str, str]) -> str:
    lines = [
        f"`{command}`", "",
        f"{config.workers} reference workers storing their answers; {config.conversations} "
        f"conversations of {config.turns} turns ({config.concurrency} at once), each next turn "
        "sending only `previous_response_id` and a new question.", "",
        "| router | next turns answered | conversations finished | failures | cached / input "
        "tokens (answered turns) | p50 ms | p99 ms | last answers found by GET |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        failures = ", ".join(f"{k} x{v}" for k, v in sorted(r.failures.items())) or "none"
        lat = r.latencies_ms
        lines.append(
            f"| {r.name} | {r.answered}/{r.next_turns} "
            f"({r.answered / r.next_turns if r.next_turns else 0:.3f}) | "
            f"{r.finished}/{config.conversations} | {failures} | "
            f"{r.cached_tokens / r.input_tokens if r.input_tokens else 0:.3f} | "
            f"{statistics.median(lat) if lat else 0:.1f} | "
            f"{percentile(lat, 99) if lat else 0:.1f} | {r.retrieved}/{r.last_ids} |")
    for name, why in skipped.items():
        lines.append(f"\n{name} skipped: {why}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_stored", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.turns < 2 or args.conversations < 1 or args.workers < 1:
        p.error("--turns must be at least 2, --conversations and --workers at least 1")
    config = StoredConfig(args.workers, args.conversations, args.turns, args.concurrency,
                          tuple(r for r in args.routers.split(",") if r), args.seed)
    command = "python -m loadtest.bench_stored " + " ".join(sys.argv[1:] if argv is None
                                                            else argv)
    results, skipped = asyncio.run(run(config))
    emit(to_markdown(config, command.strip(), results, skipped),
         json.dumps({"config": asdict(config), "results": [asdict(r) for r in results],
                     "skipped": skipped}, indent=2), args.out, as_json=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
