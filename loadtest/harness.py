"""The harness the live benchmarks share: the fleet's model and worker settings, the seeded chat
workload, a closed-loop replayer that reads each reply's route and cache headers, percentiles
and output. Processes (ports, start, stop) are :mod:`infra.procs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.contracts.headers import ENGINE_COMPUTED_HEADER, ENGINE_DONE_HEADER
from infra.procs import HOST
from loadtest.workloads import WorkloadSpec, chat_requests, describe
from worker.chat import render_chat
from worker.kvcache import block_hashes
from worker.tokenizer import HashTokenizer

__all__ = [
    "AFFINITY_WORKER_ARGS", "HOST", "MODEL", "ZERO_COST_WORKER_ARGS", "Reply", "emit",
    "ideal_hit_rate", "percentile", "post", "reason_kind", "replay", "wait_all_workers_up",
    "workload_for",
]

MODEL = "sim-model"
# Small but nonzero simulated costs for the affinity runs: the same for every policy.
AFFINITY_WORKER_ARGS = ("--prefill-us-per-token", "20", "--decode-ms-per-token", "1")
# Zero simulated costs for the overhead runs: what is left is HTTP, parsing and routing.
ZERO_COST_WORKER_ARGS = (
    "--prefill-us-per-token", "0", "--prefill-us-per-cached-token", "0",
    "--decode-ms-per-token", "0",
)


def interpreter() -> str:
    """The Python that runs this benchmark, hence the gateway and the reference workers it
    starts (``sys.executable``): its version and where it is installed. Its build matters to
    every Python router's figures: one built without profile-guided optimization and LTO (a
    version manager's default) spends 10-20% more CPU per request than a distribution's."""
    return f"{platform.python_implementation()} {platform.python_version()} ({sys.base_prefix})"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int  # 0: no HTTP answer (connection error, timeout)
    worker: str
    input_tokens: int
    matched_tokens: int
    seconds: float
    reason: str = ""  # x-route-reason
    index_blocks: int = 0  # x-prefix-match-blocks: what the gateway's index expected
    sent_at: float = 0.0  # perf_counter() when the request was sent
    # The gateway's Server-Timing (0 where it did not say): from its decision to the worker's
    # reply (upstream), and its own time (wait: from reading the request to the decision, and
    # from the reply to the answer's head).
    upstream_ms: float = 0.0
    gateway_ms: float = 0.0
    # The gateway's decision instant on its monotonic clock, seconds (x-route-at; 0: not said).
    decided_at: float = 0.0
    # The worker the gateway pre-warmed this request's prefix on at its decision
    # (x-route-prewarm; "": none).
    prewarmed_to: str = ""
    # When the worker's engine freed the request's blocks, on the same clock (x-engine-done-at,
    # relayed by our gateway from a reference worker; 0: not said).
    engine_done_at: float = 0.0
    # ... and when it had computed the prompt (its first token; x-engine-computed-at).
    engine_computed_at: float = 0.0

def reason_kind(reason: str) -> str:
    """``prefix_hit depth=37`` -> ``prefix_hit``; ``diverted: w1 ...`` -> ``diverted``."""
    if reason.startswith("ring skip"):
        return "ring skip"
    return reason.split(" ", 1)[0].rstrip(":")

def _int(headers: Any, name: str) -> int:
    try:
        return int(headers.get(name, "0"))
    except ValueError:
        return 0

def _float(headers: Any, name: str) -> float:
    try:
        value = float(headers.get(name, "0"))
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0

def server_timing(header: str) -> dict[str, float]:
    """``wait;dur=0.4, upstream;dur=7.2`` -> ``{"wait": 0.4, "upstream": 7.2}`` (durations in
    milliseconds; entries without a readable ``dur`` are left out)."""
    out: dict[str, float] = {}
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur" and name:
                try:
                    dur = float(value.strip().strip('"'))
                except ValueError:
                    continue
                if math.isfinite(dur) and dur >= 0:
                    out[name] = dur
    return out

async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Reply:
    started = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            await response.read()
            timing = server_timing(response.headers.get("Server-Timing", ""))
            return Reply(
                status=response.status,
                # Behind another router only the worker's own header names the worker.
                worker=response.headers.get("x-route-worker")
                or response.headers.get("x-worker-id")
                or "",
                input_tokens=_int(response.headers, "x-cache-input-tokens"),
                matched_tokens=_int(response.headers, "x-cache-matched-tokens"),
                seconds=time.perf_counter() - started,
                reason=response.headers.get("x-route-reason", ""),
                index_blocks=_int(response.headers, "x-prefix-match-blocks"),
                sent_at=started,
                upstream_ms=timing.get("upstream", 0.0),
                gateway_ms=timing.get("wait", 0.0),
                decided_at=_float(response.headers, "x-route-at"),
                prewarmed_to=response.headers.get("x-route-prewarm", ""),
                engine_done_at=_float(response.headers, ENGINE_DONE_HEADER),
                engine_computed_at=_float(response.headers, ENGINE_COMPUTED_HEADER),
            )
    except (aiohttp.ClientError, TimeoutError):
        return Reply(0, "", 0, 0, time.perf_counter() - started, sent_at=started)

async def replay(
    session: aiohttp.ClientSession, url: str | Sequence[str], bodies: Sequence[dict[str, Any]],
    concurrency: int, after: Sequence[int] = (), think: Sequence[float] = (),
) -> list[Reply]:
    """Send ``bodies`` in order from ``concurrency`` concurrent senders; replies in send order.

    ``url`` may be several URLs (gateway replicas): body ``i`` goes to ``url[i % len(url)]``.
    ``after[i]``: an earlier body that body ``i`` waits for the answer to (-1: none), as an
    agent sends its next turn once the last one was answered; ``think[i]``: it is sent no
    sooner than that many seconds after that answer (an agent's think time), its sender
    waiting meanwhile.
    """
    urls = [url] if isinstance(url, str) else list(url)
    replies: list[Reply | None] = [None] * len(bodies)
    order = iter(range(len(bodies)))
    answered = [asyncio.Event() for _ in bodies] if after else []
    answered_at = [0.0] * len(bodies) if think else []

    async def sender() -> None:
        for i in order:  # shared iterator: each index is taken by exactly one sender
            if answered and after[i] >= 0:  # always an earlier body, taken by some sender
                await answered[after[i]].wait()
                if think and (wait := answered_at[after[i]] + think[i] - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
            try:
                replies[i] = await post(session, urls[i % len(urls)], bodies[i])
            finally:
                if answered:
                    if think:
                        answered_at[i] = time.monotonic()
                    answered[i].set()

    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return [r for r in replies if r is not None]

def histogram_totals(text: str, name: str) -> tuple[float, int]:
    """A histogram's observations so far in a Prometheus text page: (sum, count) of ``name``,
    added up over its label sets."""
    total, count = 0.0, 0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        metric = sample.split("{", 1)[0]
        if metric == name + "_sum":
            total += float(value)
        elif metric == name + "_count":
            count += int(float(value))
    return total, count


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]

async def wait_all_workers_up(
    session: aiohttp.ClientSession, gateway: str, count: int, timeout_s: float = 30.0
) -> None:
    """Wait until the gateway has seen every worker healthy (it learns their models then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(gateway + "/admin/workers") as response:
                data = await response.json()
            if sum(1 for w in data["workers"] if w["healthy"] and w["models"]) == count:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway at {gateway} did not see {count} healthy workers")
        await asyncio.sleep(0.1)

def ideal_hit_rate(bodies: Iterable[dict[str, Any]], block_size: int = 16) -> float:
    """Hit rate of ONE unbounded cache serving ``bodies`` in order: the bound for any routing.

    Uses the reference worker's own chat template, tokenizer and block hashing, so it counts
    exactly what a worker would match if it had seen every earlier request and evicted nothing.
    """
    tokenizer = HashTokenizer()
    seen: set[int] = set()
    matched = total = 0
    for body in bodies:
        tokens = tokenizer.encode(render_chat(body["messages"]))
        hashes = block_hashes(tokens, block_size)
        depth = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        matched += depth * block_size
        total += len(tokens)
        seen.update(hashes)
    return matched / total if total else 0.0

def workload_for(
    seed: int, requests: int, max_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The seeded chat workload and its description (with the one-cache bound)."""
    spec = WorkloadSpec(seed=seed, model=MODEL, max_tokens=max_tokens)
    bodies = list(chat_requests(spec, requests))
    workload: dict[str, Any] = dict(describe(spec, requests))
    workload["ideal_hit_rate"] = ideal_hit_rate(bodies)
    return bodies, workload

def emit(markdown: str, json_text: str, out: Path | None, *, as_json: bool) -> None:
    """Print the result (markdown, or JSON with ``--json``) and write the markdown to ``out``."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown, encoding="utf-8")
    print(json_text if as_json else markdown, end="\n" if as_json else "")
