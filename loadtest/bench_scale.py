"""Benchmark: scaling out mid-load, with and without warm-up on join.

``python -m loadtest.bench_scale [--rate 12] [--before-s 60] [--after-s 90] [--modes warmup,cold]
[--out DIR]``

All modes run at once, each on its own ports (so they share the machine's noise), each with a
real redis-server, ``--workers`` reference workers (simulated engine, its default costs: 200 us
per uncached prompt token, 5 us per cached one) that register in it, and a gateway on that
store that samples prompts for warm-up (``--warmup-sample '*'``; ``cold`` runs it with
``--no-warmup``; ``noprewarm`` warms joining workers but runs without predictive pre-warming
(``--no-prewarm``), to tell the two apart; ``peers`` samples nothing and warms a joining
worker only from the prompts the serving workers export (workers with an admin token, the
gateway with ``--worker-admin-token``); ``control`` adds no workers at all, so it shows how
the hit rate of the load itself drifts over the same minutes). An open-loop chat +
shared-system-prompt load (:func:`loadtest.workloads.chat_requests`, streaming) arrives at
``--rate`` requests per second; after ``--before-s`` seconds ``--add`` more workers join
(they were started, idle and unregistered, before the load, so their Python start-up does not
fall into the transition on a busy machine; they join by registering in the store as a worker
does), and the load goes on for ``--after-s`` seconds.

Reported per mode: token hit rate and TTFT (time to the first content token) p50/p99 in the
``--steady-s`` seconds before the change (steady state) and in the ``--window-s`` seconds after
it, p99 after / p99 before, failed requests, and the seconds until the hit rate (over 10 s
windows) is back within 1 point of the steady state for good, and (with a ``control`` mode in
the run) until it is back within 1 point of the control's hit rate over the same windows.
``report.md``, ``report.json``, ``scale.png`` (hit rate and TTFT p99 over time per mode) and
the raw samples go to ``--out``.

A benchmark, not a test: figures depend on the machine; compare the modes side by side only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.contracts.registry import RegistryClient
from gateway.store.base import WorkerRecord
from infra.local import stop_processes, wait_healthy
from loadtest.bench_gateway import free_port_block, percentile
from loadtest.workloads import WorkloadSpec, chat_requests
from worker.register import heartbeat

HOST = "127.0.0.1"
BUCKET_S = 5.0
RECOVERY_WINDOW_S = 10.0


class RedisServer:
    """A throwaway redis-server on loopback (no persistence)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://{HOST}:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((HOST, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    workers: int = 4
    add: int = 2
    rate: float = 12.0
    before_s: float = 60.0
    after_s: float = 90.0
    steady_s: float = 30.0
    window_s: float = 60.0
    cache_blocks: int = 2048
    tenants: int = 12
    max_tokens: int = 4
    seed: int = 2024
    modes: tuple[str, ...] = ("warmup", "cold", "control")
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    logs: Path | None = None  # keep the servers' logs there (default: deleted after the run)
    repeats: int = 1  # whole side-by-side runs, each with its own seed; the report gives medians


@dataclass(slots=True)
class Sample:
    t: float  # seconds since the scale event (negative: before it)
    ttft_s: float
    ok: bool
    input_tokens: int
    matched_tokens: int
    worker: str
    error: str = ""  # why it failed


@dataclass(slots=True)
class ModeResult:
    mode: str
    samples: list[Sample] = field(default_factory=list)
    warmup: list[dict[str, Any]] = field(default_factory=list)  # /admin/workers "warmup"s
    prewarm: dict[str, Any] = field(default_factory=dict)  # /admin/workers "prewarm" counts

    def window(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.t < end]


def hit_rate(samples: Sequence[Sample]) -> float:
    total = sum(s.input_tokens for s in samples if s.ok)
    return sum(s.matched_tokens for s in samples if s.ok) / total if total else 0.0


def ttft(samples: Sequence[Sample], q: float) -> float:
    """The ``q``-th percentile (0-100] of TTFT over the requests that succeeded."""
    values = [s.ttft_s for s in samples if s.ok]
    return percentile(values, q) if values else float("nan")


def recovery_s(result: ModeResult, steady: float, end: float) -> float | None:
    """Seconds from the change until the hit rate is back within 1 point of steady state for
    good: the end of the last 10 s window (slid by 1 s) below that, 0 if there is none; None
    if the last window of the run is still below it."""
    last_below: float | None = None
    t = 0.0
    while t + RECOVERY_WINDOW_S <= end:
        if hit_rate(result.window(t, t + RECOVERY_WINDOW_S)) < steady - 0.01:
            last_below = t + RECOVERY_WINDOW_S
        t += 1.0
    if last_below is None:
        return 0.0
    return None if last_below > end - 1.0 else last_below


def recovery_vs_s(result: ModeResult, reference: ModeResult, end: float) -> float | None:
    """Like :func:`recovery_s`, against ``reference``'s hit rate over the same windows (the
    control run, whose load is the same and whose fleet never changes)."""
    last_below: float | None = None
    t = 0.0
    while t + RECOVERY_WINDOW_S <= end:
        own = hit_rate(result.window(t, t + RECOVERY_WINDOW_S))
        if own < hit_rate(reference.window(t, t + RECOVERY_WINDOW_S)) - 0.01:
            last_below = t + RECOVERY_WINDOW_S
        t += 1.0
    if last_below is None:
        return 0.0
    return None if last_below > end - 1.0 else last_below


def summarize(result: ModeResult, config: ScaleConfig,
              control: ModeResult | None = None) -> dict[str, Any]:
    steady = result.window(-config.steady_s, 0.0)
    after = result.window(0.0, config.window_s)
    steady_hit = hit_rate(steady)
    p99_before, p99_after = ttft(steady, 99), ttft(after, 99)
    control_p99 = (ttft(control.window(0.0, config.window_s), 99) if control is not None
                   else float("nan"))
    return {
        "mode": result.mode,
        "requests": len(result.samples),
        "failed": sum(1 for s in result.samples if not s.ok),
        "steady_hit_rate": steady_hit,
        "steady_ttft_p50_ms": 1000 * ttft(steady, 50),
        "steady_ttft_p99_ms": 1000 * p99_before,
        "after_hit_rate": hit_rate(after),
        "after_ttft_p50_ms": 1000 * ttft(after, 50),
        "after_ttft_p99_ms": 1000 * p99_after,
        "p99_ratio": p99_after / p99_before if p99_before > 0 else float("nan"),
        "p99_vs_control": p99_after / control_p99 if control_p99 > 0 else float("nan"),
        "new_worker_requests": sum(
            1 for s in after if s.worker in _new_workers(result, config)),
        "recovery_s": recovery_s(result, steady_hit, config.after_s),
        "recovery_vs_control_s": (recovery_vs_s(result, control, config.after_s)
                                  if control is not None else float("nan")),
        "warmup": result.warmup,
        "prewarms_sent": int(result.prewarm.get("sent", 0)),
        "prewarms_placed": int(result.prewarm.get("placed", 0)),
    }


def _new_workers(result: ModeResult, config: ScaleConfig) -> set[str]:
    before = {s.worker for s in result.window(-config.before_s, 0.0)}
    return {s.worker for s in result.samples if s.t >= 0 and s.worker not in before}


async def stream_one(http: aiohttp.ClientSession, gateway: str, body: dict[str, Any],
                     t0: float, out: list[Sample]) -> None:
    sent = time.monotonic()
    first: float | None = None
    ok, inp, matched, worker, error = False, 0, 0, "", ""
    try:
        async with http.post(gateway + "/v1/chat/completions",
                             json={**body, "stream": True}) as r:
            inp = int(r.headers.get("x-cache-input-tokens", "0"))
            matched = int(r.headers.get("x-cache-matched-tokens", "0"))
            worker = r.headers.get("x-route-worker", "")
            if r.status >= 500:  # the gateway's reason, for the report
                raise ValueError(f"HTTP {r.status}: " + _error_of(await r.read())[:160])
            async for line in r.content:
                if first is None and line.startswith(b"data: {") and _has_content(line[6:]):
                    first = time.monotonic()
                if line.startswith(b"data: {") and _error_of(line[6:]):
                    raise ValueError(_error_of(line[6:]))
            ok = r.status == 200 and first is not None
            if r.status != 200:
                error = f"HTTP {r.status}"
    except ValueError as exc:
        ok, error = False, str(exc)[:200]
    except (aiohttp.ClientError, TimeoutError) as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"[:200]
    out.append(Sample(sent - t0, (first or time.monotonic()) - sent, ok, inp, matched, worker,
                      error))


def _error_of(payload: bytes) -> str:
    try:
        chunk = json.loads(payload)
    except ValueError:
        return ""
    error = chunk.get("error") if isinstance(chunk, dict) else None
    return str(error.get("message") or error) if error else ""


def _has_content(payload: bytes) -> bool:
    try:
        chunk = json.loads(payload)
    except ValueError:
        return False
    choices = chunk.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def start_server(cmd: Sequence[str], url: str, log_path: Path,
                       procs: list[asyncio.subprocess.Process]) -> None:
    """Start one server (output to ``log_path``) and wait until it answers /health (a slow,
    shared machine may take a while to import everything)."""
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
    procs.append(proc)
    await wait_healthy(url, timeout_s=180.0)


def _worker_cmd(port: int, redis: str, config: ScaleConfig, mode: str) -> list[str]:
    """A worker that registers itself (``redis``), or not (empty: the bench registers it)."""
    url = f"http://{HOST}:{port}"
    store = ["--store", redis, "--public-url", url, "--heartbeat-s", "0.5",
             "--registry-ttl-s", "3"] if redis else []
    return [sys.executable, "-m", "worker", "--host", HOST, "--port", str(port), *store,
            "--cache-blocks", str(config.cache_blocks), *mode_worker_args(mode),
            *config.worker_args]


MODES = ("warmup", "cold", "noprewarm", "peers", "control")
PEERS_TOKEN = "bench-scale-admin"  # the workers' admin token in the peers mode (loopback only)


def mode_gateway_args(mode: str) -> tuple[str, ...]:
    """The gateway flags of a mode: every mode but ``peers`` samples prompts for warm-up."""
    sample = ("--warmup-sample", "*")
    return {"cold": (*sample, "--no-warmup"), "noprewarm": (*sample, "--no-prewarm"),
            "peers": ("--worker-admin-token", PEERS_TOKEN)}.get(mode, sample)


def mode_worker_args(mode: str) -> tuple[str, ...]:
    """The worker flags of a mode: in ``peers`` the workers export their hottest prompts."""
    return ("--admin-token", PEERS_TOKEN) if mode == "peers" else ()


async def run_mode(mode: str, config: ScaleConfig, base: int, logs: Path) -> ModeResult:
    redis = RedisServer(base + config.workers + config.add + 1)
    await asyncio.to_thread(redis.start)
    procs: list[asyncio.subprocess.Process] = []
    result = ModeResult(mode)
    if mode == "control":
        config = dataclasses.replace(config, add=0)
    try:
        # The workers that join later start now, unregistered: their Python start-up must not
        # fall into the transition window of a busy machine. They join by registering.
        await asyncio.gather(*(
            start_server(_worker_cmd(base + i, redis.url if i < config.workers else "", config,
                                     mode),
                         f"http://{HOST}:{base + i}", logs / f"{mode}-worker{i}.log", procs)
            for i in range(config.workers + config.add)))
        gport = base + config.workers + config.add
        gateway = f"http://{HOST}:{gport}"
        gcmd = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(gport),
                "--store", redis.url, "--health-interval-s", "1", *mode_gateway_args(mode),
                *config.gateway_args]
        await start_server(gcmd, gateway, logs / f"{mode}-gateway.log", procs)
        connector = aiohttp.TCPConnector(limit=512)
        async with aiohttp.ClientSession(connector=connector) as http:
            await _until_workers(http, gateway, config.workers)
            await _load(http, gateway, config, result, procs, redis.url, base, logs)
            async with http.get(gateway + "/admin/workers") as r:
                view = await r.json()
            result.warmup = [w["warmup"] | {"id": w["id"]} for w in view["workers"]
                             if w.get("warmup")]
            result.prewarm = dict(view.get("prewarm") or {})
    finally:
        await stop_processes(procs, grace_s=5.0)
        await asyncio.to_thread(redis.stop)
    return result


async def _until_workers(http: aiohttp.ClientSession, gateway: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        async with http.get(gateway + "/admin/workers") as r:
            view = await r.json()
        if sum(1 for w in view["workers"] if w["healthy"]) >= count:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{count} workers did not come up")


async def _load(http: aiohttp.ClientSession, gateway: str, config: ScaleConfig,
                result: ModeResult, procs: list[asyncio.subprocess.Process], redis: str,
                base: int, logs: Path) -> None:
    spec = WorkloadSpec(seed=config.seed, tenants=config.tenants, max_tokens=config.max_tokens)
    total = int(config.rate * (config.before_s + config.after_s))
    bodies = list(chat_requests(spec, total))
    rng = random.Random(config.seed)
    start = time.monotonic()
    t0 = start + config.before_s
    tasks: list[asyncio.Task[None]] = []
    scaled: asyncio.Task[None] | None = None
    at = 0.0
    for body in bodies:
        at += rng.expovariate(config.rate)
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if scaled is None and config.add and time.monotonic() >= t0:
            scaled = asyncio.create_task(_scale(config, procs, redis, base, logs, result.mode))
        tasks.append(asyncio.create_task(stream_one(http, gateway, body, t0, result.samples)))
    await asyncio.gather(*tasks)
    if scaled is not None:
        scaled.cancel()
        await asyncio.gather(scaled, return_exceptions=True)
    result.samples.sort(key=lambda s: s.t)


async def _scale(config: ScaleConfig, procs: list[asyncio.subprocess.Process], redis: str,
                 base: int, logs: Path, mode: str) -> None:
    """The extra workers join: registered in the store as a worker registers itself, with
    heartbeats until the run ends."""
    store = RegistryClient(redis)
    beats = []
    try:
        for i in range(config.workers, config.workers + config.add):
            record = WorkerRecord(id=f"{HOST}:{base + i}", url=f"http://{HOST}:{base + i}",
                                  models=("sim-model",), capacity_blocks=config.cache_blocks)
            await store.register(record, ttl_s=3.0)
            beats.append(asyncio.create_task(heartbeat(store, record, 0.5, 3.0)))
        await asyncio.sleep(config.after_s + 5)
    finally:
        for beat in beats:
            beat.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        await store.close()


def buckets(result: ModeResult, config: ScaleConfig) -> list[dict[str, float]]:
    out = []
    t = -config.before_s
    while t < config.after_s:
        chunk = result.window(t, t + BUCKET_S)
        if chunk:
            out.append({"t": t + BUCKET_S / 2, "hit_rate": hit_rate(chunk),
                        "ttft_p99_ms": 1000 * ttft(chunk, 99),
                        "ttft_p50_ms": 1000 * ttft(chunk, 50)})
        t += BUCKET_S
    return out


def plot(results: Sequence[ModeResult], config: ScaleConfig, path: Path) -> None:
    import matplotlib  # a benchmark-only dependency (the 'loadtest' extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for result in results:
        series = buckets(result, config)
        xs = [b["t"] for b in series]
        top.plot(xs, [b["hit_rate"] for b in series], marker=".", label=result.mode)
        bottom.plot(xs, [b["ttft_p99_ms"] for b in series], marker=".", label=result.mode)
    for ax in (top, bottom):
        ax.axvline(0.0, color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend()
    top.set_ylabel(f"token hit rate ({BUCKET_S:.0f} s buckets)")
    bottom.set_ylabel("TTFT p99 (ms)")
    bottom.set_xlabel(f"seconds since scaling {config.workers} -> "
                      f"{config.workers + config.add} workers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def to_markdown(summaries: Sequence[dict[str, Any]], config: ScaleConfig, command: str) -> str:
    lines = [
        f"`{command}`", "",
        f"{config.workers} -> {config.workers + config.add} reference workers (sim engine, "
        f"{config.cache_blocks} blocks each), {config.rate:g} req/s open loop, chat + "
        f"{config.tenants} shared system prompts, streaming; steady = the {config.steady_s:g} s "
        f"before the change, after = the {config.window_s:g} s after it.", "",
        "| mode | requests | failed | steady hit | after hit | steady TTFT p50 / p99 ms | "
        "after TTFT p50 / p99 ms | p99 after/steady | to within 1 pt (s) | "
        "to within 1 pt of control (s) | new workers' reqs | p99 after / control's | "
        "pre-warms sent / placed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        rec = s["recovery_s"]
        vs = s["recovery_vs_control_s"]
        vs_text = "-" if vs != vs else "never" if vs is None else f"{vs:.0f}"  # NaN: no control
        lines.append(
            f"| {s['mode']} | {s['requests']} | {s['failed']} | {s['steady_hit_rate']:.3f} | "
            f"{s['after_hit_rate']:.3f} | {s['steady_ttft_p50_ms']:.0f} / "
            f"{s['steady_ttft_p99_ms']:.0f} | {s['after_ttft_p50_ms']:.0f} / "
            f"{s['after_ttft_p99_ms']:.0f} | {s['p99_ratio']:.2f} | "
            f"{'never' if rec is None else f'{rec:.0f}'} | {vs_text} | "
            f"{s['new_worker_requests']} | {s['p99_vs_control']:.2f} | "
            f"{s['prewarms_sent']} / {s['prewarms_placed']} |")
    for s in summaries:
        for w in s["warmup"]:
            if w.get("reason") == "joined":
                lines.append("")
                lines.append(
                    f"{s['mode']}: {w['id']} warm-up {w['phase']}: {w['done_prompts']}/"
                    f"{w['planned_prompts']} prompts ({w['done_blocks']} blocks), "
                    f"{w['failed_prompts']} failed, "
                    f"{(w['finished_at'] or 0) - w['started_at']:.1f} s incl. ramp")
    return "\n".join(lines) + "\n"


MEDIAN_FIELDS = (
    "steady_hit_rate", "after_hit_rate", "steady_ttft_p99_ms", "after_ttft_p99_ms",
    "p99_ratio", "p99_vs_control", "new_worker_requests", "prewarms_sent", "prewarms_placed",
)


def median_summaries(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per mode (in the order of the first run), the median of each field over the repeats,
    each repeat's p99 ratio as it was, and the failed requests of all repeats together."""
    out = []
    for first in runs[0]:
        mode = first["mode"]
        rows = [next(s for s in summaries if s["mode"] == mode) for summaries in runs]
        merged: dict[str, Any] = {"mode": mode, "repeats": len(rows),
                                  "failed": sum(r["failed"] for r in rows),
                                  "requests": sum(r["requests"] for r in rows),
                                  "p99_ratios": [r["p99_ratio"] for r in rows]}
        for name in MEDIAN_FIELDS:
            merged[name] = statistics.median(r[name] for r in rows)
        out.append(merged)
    return out


def medians_markdown(medians: Sequence[dict[str, Any]], config: ScaleConfig,
                     command: str) -> str:
    lines = [
        f"`{command}`", "",
        f"Medians of {config.repeats} repeats (each repeat: every mode side by side; its own "
        "report in repeatN/).", "",
        "| mode | requests | failed | steady hit | after hit | steady TTFT p99 ms | "
        "after TTFT p99 ms | p99 after/steady | (each repeat) | p99 after / control's | "
        "new workers' reqs | pre-warms sent / placed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in medians:
        each = ", ".join(f"{r:.2f}" for r in m["p99_ratios"])
        lines.append(
            f"| {m['mode']} | {m['requests']} | {m['failed']} | {m['steady_hit_rate']:.3f} | "
            f"{m['after_hit_rate']:.3f} | {m['steady_ttft_p99_ms']:.0f} | "
            f"{m['after_ttft_p99_ms']:.0f} | {m['p99_ratio']:.2f} | {each} | "
            f"{m['p99_vs_control']:.2f} | {m['new_worker_requests']:.0f} | "
            f"{m['prewarms_sent']:.0f} / {m['prewarms_placed']:.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> tuple[ScaleConfig, Path]:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ScaleConfig()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--add", type=int, default=d.add)
    p.add_argument("--rate", type=float, default=d.rate)
    p.add_argument("--before-s", type=float, default=d.before_s)
    p.add_argument("--after-s", type=float, default=d.after_s)
    p.add_argument("--steady-s", type=float, default=d.steady_s)
    p.add_argument("--window-s", type=float, default=d.window_s)
    p.add_argument("--cache-blocks", type=int, default=d.cache_blocks)
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--modes", default=",".join(d.modes),
                   help=f"{', '.join(MODES)} (comma list)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag")
    p.add_argument("--out", type=Path, default=Path("loadtest/out/scale"))
    p.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="run everything this many times (each repeat's report in "
                        "OUT/repeatN); OUT/report.md gives each mode's medians")
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes {', '.join(MODES)}")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    config = ScaleConfig(
        workers=a.workers, add=a.add, rate=a.rate, before_s=a.before_s, after_s=a.after_s,
        steady_s=a.steady_s, window_s=a.window_s, cache_blocks=a.cache_blocks,
        tenants=a.tenants, max_tokens=a.max_tokens, seed=a.seed, modes=modes,
        worker_args=tuple(a.worker_arg),
        gateway_args=tuple(a.gateway_arg), logs=a.logs, repeats=a.repeats)
    return config, a.out


async def run(config: ScaleConfig, logs: Path) -> list[ModeResult]:
    """Every mode at once, each on its own ports with the same seeded load: on a shared,
    noisy machine they see the same noise, so their figures compare side by side."""
    # Below the ephemeral range, so no client connection takes a port during the run.
    size = config.workers + config.add + 2
    bases: list[int] = []
    for b in range(21000, 32000, 32):
        if len(bases) == len(config.modes):
            break
        if ports_free(range(b, b + size)):
            bases.append(b)
    pairs = zip(config.modes, bases, strict=True)
    return list(await asyncio.gather(*(run_mode(m, config, b, logs) for m, b in pairs)))


def repeat_config(config: ScaleConfig, index: int) -> ScaleConfig:
    """Repeat ``index`` (from 0) draws its load from seed + index: every mode of a repeat gets
    the same load, each repeat another one (a seed's bursts of arrivals would otherwise fall
    at the same instants in every repeat)."""
    return dataclasses.replace(config, seed=config.seed + index)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection in this (the client's) process while the load runs: one
    client drives every mode, so a full collection of its heap would stall every mode's
    requests at once and show up as the servers' TTFT. Reference counting still frees almost
    everything; what is cyclic is collected afterwards."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect()


def ports_free(ports: range) -> bool:
    try:
        free_port_block(len(ports), ports.start)
    except RuntimeError:
        return False
    return True


def write_report(results: Sequence[ModeResult], config: ScaleConfig, out: Path,
                 command: str) -> list[dict[str, Any]]:
    control = next((r for r in results if r.mode == "control"), None)
    summaries = [summarize(r, config, control) for r in results]
    out.mkdir(parents=True, exist_ok=True)
    plot(results, config, out / "scale.png")
    (out / "report.md").write_text(to_markdown(summaries, config, command))
    (out / "report.json").write_text(json.dumps(
        {"config": asdict(config), "summaries": summaries,
         "buckets": {r.mode: buckets(r, config) for r in results}}, indent=2, default=str))
    (out / "samples.json").write_text(json.dumps(
        {r.mode: [asdict(s) for s in r.samples] for r in results}))
    return summaries


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config, out = parse_args(args)
    command = " ".join(["python -m loadtest.bench_scale", *args])
    if shutil.which("redis-server") is None:
        print("redis-server is needed (workers join through the registry)", file=sys.stderr)
        return 2
    keep = config.logs is not None
    logs = config.logs if config.logs is not None else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[list[dict[str, Any]]] = []
    try:
        for i in range(config.repeats):
            this = repeat_config(config, i)
            with collector_paused():
                results = asyncio.run(run(this, logs))
            where = out / f"repeat{i + 1}" if config.repeats > 1 else out
            runs.append(write_report(results, this, where, command))
            print((where / "report.md").read_text())
    finally:
        if not keep:
            shutil.rmtree(logs, ignore_errors=True)
    if config.repeats > 1:
        medians = median_summaries(runs)
        (out / "report.md").write_text(medians_markdown(medians, config, command))
        (out / "report.json").write_text(json.dumps(
            {"config": asdict(config), "medians": medians, "repeats": runs}, indent=2,
            default=str))
        print((out / "report.md").read_text())
    return 0 if all(s["requests"] for summaries in runs for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
