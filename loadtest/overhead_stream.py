"""The streaming phase of :mod:`loadtest.bench_overhead`: what relaying a token stream costs.

Most LLM traffic is streamed, and a streamed answer is one server-sent event per token: beyond a
few hundred tokens the router's cost per event outweighs its cost per request. With
``--stream-tokens N``, after the other phases, each router gets ``--stream-requests`` chat
requests with ``"stream": true`` and ``max_tokens`` N (the zero-cost workers send N token
events as fast as they can), ``--stream-concurrency`` at a time, over ``--stream-reps`` rounds
(targets in rotating order). Reported per router: CPU ms per streamed request, CPU µs per
event (the request's own cost, from the throughput phase, taken out), events per request and
wall time per request; medians over the rounds. Loopback only; a benchmark, not a test.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from loadtest.peers import proc_tree_cpu_s
from loadtest.workloads import words

_JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class StreamConfig:
    tokens: int = 0  # 0: the phase does not run
    requests: int = 50
    concurrency: int = 4
    reps: int = 3


@dataclass(slots=True)
class StreamResult:
    cpu_ms: list[float] = field(default_factory=list)  # per round: router CPU ms per request
    events: list[float] = field(default_factory=list)  # per round: events per request
    wall_ms: list[float] = field(default_factory=list)  # per round: wall ms per request
    errors: int = 0

    def per_event_us(self, request_cpu_ms: float) -> float:
        """CPU µs per event: the streamed request's CPU less a plain request's, per event."""
        events = statistics.median(self.events) if self.events else 0.0
        if not events or not self.cpu_ms:
            return 0.0
        return max(0.0, statistics.median(self.cpu_ms) - request_cpu_ms) * 1e3 / events


def stream_bodies(model: str, config: StreamConfig, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [
        json.dumps({
            "model": model, "max_tokens": config.tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Story {i}: {words(rng, 40)}"}],
        }).encode()
        for i in range(config.requests)
    ]


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[bool, int]:
    """(answered 200, SSE events received) for one streamed request."""
    events = 0
    try:
        async with session.post(url, data=body, headers=_JSON) as response:
            async for line in response.content:
                events += line.startswith(b"data:")
            return response.status == 200, events
    except (aiohttp.ClientError, TimeoutError):
        return False, events


async def stream_round(session: aiohttp.ClientSession, url: str, pid: int,
                       bodies: Sequence[bytes], concurrency: int,
                       result: StreamResult) -> None:
    """One round of ``bodies`` to one router; appends its figures to ``result``."""
    order = iter(bodies)
    events = 0

    async def sender() -> None:
        nonlocal events
        for body in order:
            ok, n = await _one(session, url, body)
            events += n
            result.errors += not ok

    cpu0 = await asyncio.to_thread(proc_tree_cpu_s, pid)
    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    cpu1 = await asyncio.to_thread(proc_tree_cpu_s, pid)
    n = len(bodies)
    result.cpu_ms.append((cpu1 - cpu0) * 1e3 / n)
    result.events.append(events / n)
    result.wall_ms.append(wall * 1e3 * concurrency / n)


def stream_table(config: StreamConfig, results: dict[str, StreamResult],
                 request_cpu_ms: dict[str, float], reference: str) -> list[str]:
    """Markdown lines for the streaming phase (empty when it did not run)."""
    if not config.tokens or not results:
        return []
    lines = ["", f"Streams: {config.requests} chat requests per round with `\"stream\": true` "
             f"and `max_tokens` {config.tokens}, {config.concurrency} at a time, "
             f"{config.reps} round(s), targets rotated; medians over the rounds. Per event: "
             "the streamed request's CPU less a plain request's (throughput phase), divided "
             "by its events.", "",
             "| router | CPU ms / stream | CPU µs / event | events / stream | wall ms / stream "
             "| errors |", "|---|---:|---:|---:|---:|---:|"]
    per_event = {name: r.per_event_us(request_cpu_ms.get(name, 0.0))
                 for name, r in results.items()}
    for name, r in results.items():
        lines.append(
            f"| {name} | {statistics.median(r.cpu_ms):.3f} ("
            + ", ".join(f"{v:.3f}" for v in r.cpu_ms) + f") | {per_event[name]:.1f} | "
            f"{statistics.median(r.events):.0f} | {statistics.median(r.wall_ms):.1f} | "
            f"{r.errors} |")
    ref = per_event.get(reference, 0.0)
    if ref:
        lines += ["", f"CPU per event over {reference}'s: " + ", ".join(
            f"{name} {v / ref:.2f}x" for name, v in per_event.items() if name != reference)]
    return lines
