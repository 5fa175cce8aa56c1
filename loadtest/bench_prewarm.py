"""Benchmark: predictive pre-warming under a surge of one shared prompt.

``python -m loadtest.bench_prewarm [--workers 3] [--base-rate 4] [--surge-from 2]
[--surge-to 40] [--ramp-s 30] [--hold-s 20] [--system-chars 24000] [--repeats 1]
[--gateway-from LABEL=DIR] [--out DIR]``

Every mode at once, each on its own ports (so they share the machine's noise): ``--workers``
reference workers (simulated engine, its default costs: 200 us per uncached prompt token, 5 us
per cached one) and a gateway over them on its embedded store. ``prewarm`` runs the gateway as
it ships; ``noprewarm`` adds ``--no-prewarm``; each ``--gateway-from LABEL=DIR`` adds a mode
LABEL whose gateway (as it ships) runs from the checkout in DIR, for an A/B of a change. The
same seeded open-loop load goes to every mode: chat over a few tenants' system prompts at
``--base-rate`` requests per second, plus one long shared prompt (``--system-chars``) whose own
rate climbs from ``--surge-from`` to ``--surge-to`` over ``--ramp-s`` seconds, after
``--before-s`` seconds of the base load alone, and holds for ``--hold-s``. Every surge request
is that prompt and a question of its own.

One worker cannot serve the whole surge, so the routing policy spreads the prompt to more
workers as its holder's queue grows. Without pre-warming, the first request on each new holder
prefills the whole prompt on the critical path; with it, the gateway has replayed the prompt
there (``max_tokens`` 1) as the holder neared that point.

Reported per mode: the surge requests' TTFT p50/p99 and how many of them missed most of the
prompt (matched under half their input tokens, as the workers report), the workers that served
the surge prompt, the base load's TTFT p99, failed requests, and the pre-warms the gateway sent
and placed (``/admin/workers``). With ``--repeats N``, each mode's medians too.

A benchmark, not a test: figures depend on the machine; compare the modes side by side only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from infra.local import stop_processes
from infra.procs import from_checkout
from loadtest.bench_gateway import percentile
from loadtest.bench_scale import (
    HOST,
    Sample,
    collector_paused,
    ports_free,
    start_server,
    stream_one,
)
from loadtest.workloads import WorkloadSpec, chat_requests, question, system_prompt

MODES = ("prewarm", "noprewarm")


@dataclass(frozen=True, slots=True)
class SurgeConfig:
    workers: int = 3
    base_rate: float = 4.0
    surge_from: float = 2.0
    surge_to: float = 40.0
    before_s: float = 20.0
    ramp_s: float = 30.0
    hold_s: float = 20.0
    system_chars: int = 24_000
    max_tokens: int = 16
    tenants: int = 4
    seed: int = 7
    repeats: int = 1
    modes: tuple[str, ...] = MODES
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()  # (mode label, checkout its gateway runs from)


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds since the load started
    body: dict[str, Any]
    surge: bool


def surge_rate(config: SurgeConfig, t: float) -> float:
    """The surge prompt's rate ``t`` seconds after the load started (0 before the surge)."""
    s = t - config.before_s
    if s < 0 or s >= config.ramp_s + config.hold_s:
        return 0.0
    share = min(s / config.ramp_s, 1.0) if config.ramp_s > 0 else 1.0
    return config.surge_from + (config.surge_to - config.surge_from) * share


def arrivals(config: SurgeConfig) -> list[Arrival]:
    """The whole load, seeded: Poisson base arrivals, and the surge's arrivals drawn by
    thinning a Poisson stream of the peak rate down to :func:`surge_rate`."""
    rng = random.Random(config.seed)
    total_s = config.before_s + config.ramp_s + config.hold_s
    spec = WorkloadSpec(seed=config.seed, tenants=config.tenants, max_tokens=config.max_tokens)
    base = chat_requests(spec, int(config.base_rate * total_s * 2) + 16)
    out: list[Arrival] = []
    t = 0.0
    while config.base_rate > 0:
        t += rng.expovariate(config.base_rate)
        if t >= total_s:
            break
        out.append(Arrival(t, next(base), False))
    prompt = system_prompt(config.seed, 1000, (config.system_chars, config.system_chars))
    peak = max(config.surge_from, config.surge_to)
    t = config.before_s
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= total_s:
            break
        if rng.random() * peak < surge_rate(config, t):
            body = {"model": spec.model, "max_tokens": config.max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": prompt},
                                 {"role": "user", "content": question(rng, spec)}]}
            out.append(Arrival(t, body, True))
    out.sort(key=lambda a: a.at)
    return out


@dataclass(slots=True)
class ModeResult:
    mode: str
    surge: list[Sample] = field(default_factory=list)
    base: list[Sample] = field(default_factory=list)
    prewarm: dict[str, Any] = field(default_factory=dict)


def summarize(result: ModeResult) -> dict[str, Any]:
    surge_ok = [s for s in result.surge if s.ok]
    base_ok = [s for s in result.base if s.ok]
    cold = [s for s in surge_ok if s.matched_tokens * 2 < s.input_tokens]
    return {
        "mode": result.mode,
        "surge_requests": len(result.surge),
        "failed": sum(1 for s in (*result.surge, *result.base) if not s.ok),
        "surge_ttft_p50_ms": 1000 * _q(surge_ok, 50),
        "surge_ttft_p99_ms": 1000 * _q(surge_ok, 99),
        "surge_cold": len(cold),
        "surge_cold_ttft_p50_ms": 1000 * _q(cold, 50),
        "surge_workers": len({s.worker for s in surge_ok}),
        "base_ttft_p99_ms": 1000 * _q(base_ok, 99),
        "prewarms_sent": int(result.prewarm.get("sent", 0)),
        "prewarms_placed": int(result.prewarm.get("placed", 0)),
    }


def _q(samples: Sequence[Sample], q: float) -> float:
    return percentile([s.ttft_s for s in samples], q) if samples else float("nan")


async def run_mode(mode: str, config: SurgeConfig, base: int, logs: Path,
                   load: Sequence[Arrival]) -> ModeResult:
    procs: list[asyncio.subprocess.Process] = []
    result = ModeResult(mode)
    try:
        urls = [f"http://{HOST}:{base + i}" for i in range(config.workers)]
        await asyncio.gather(*(
            start_server([sys.executable, "-m", "worker", "--host", HOST, "--port",
                          str(base + i), *config.worker_args], urls[i],
                         logs / f"{mode}-worker{i}.log", procs)
            for i in range(config.workers)))
        gport = base + config.workers
        gateway = f"http://{HOST}:{gport}"
        gcmd = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(gport),
                "--health-interval-s", "1", *(a for u in urls for a in ("--worker", u)),
                *(("--no-prewarm",) if mode == "noprewarm" else ()), *config.gateway_args]
        gcmd = from_checkout(gcmd, dict(config.sources).get(mode, ""))
        await start_server(gcmd, gateway, logs / f"{mode}-gateway.log", procs)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024)) as http:
            await _replay(http, gateway, load, result)
            async with http.get(gateway + "/admin/workers") as r:
                result.prewarm = dict((await r.json()).get("prewarm") or {})
    finally:
        await stop_processes(procs, grace_s=5.0)
    return result


async def _replay(http: aiohttp.ClientSession, gateway: str, load: Sequence[Arrival],
                  result: ModeResult) -> None:
    start = time.monotonic()
    tasks = []
    for arrival in load:
        delay = start + arrival.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        out = result.surge if arrival.surge else result.base
        tasks.append(asyncio.create_task(stream_one(http, gateway, arrival.body, start, out)))
    await asyncio.gather(*tasks)


async def run(config: SurgeConfig, logs: Path) -> list[ModeResult]:
    load = arrivals(config)
    size = config.workers + 1
    bases: list[int] = []
    for b in range(33000, 40000, 16):  # below the ephemeral range
        if len(bases) == len(config.modes):
            break
        if ports_free(range(b, b + size)):
            bases.append(b)
    pairs = zip(config.modes, bases, strict=True)
    return list(await asyncio.gather(*(run_mode(m, config, b, logs, load) for m, b in pairs)))


FIELDS = ("surge_ttft_p50_ms", "surge_ttft_p99_ms", "surge_cold", "surge_cold_ttft_p50_ms",
          "surge_workers", "base_ttft_p99_ms", "prewarms_sent", "prewarms_placed")


def to_markdown(runs: Sequence[Sequence[dict[str, Any]]], config: SurgeConfig,
                command: str) -> str:
    lines = [
        f"`{command}`", "",
        f"{config.workers} reference workers per mode; base chat load {config.base_rate:g} "
        f"req/s; one {config.system_chars:,}-character shared prompt climbing from "
        f"{config.surge_from:g} to {config.surge_to:g} req/s over {config.ramp_s:g} s, then "
        f"{config.hold_s:g} s at the peak. Cold = a surge request that matched under half its "
        "input tokens.", "",
        "| repeat | mode | surge requests | failed | surge TTFT p50 / p99 ms | cold surge "
        "requests (their p50 ms) | workers serving it | base TTFT p99 ms | pre-warms sent / "
        "placed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(str(i + 1), s) for i, summaries in enumerate(runs) for s in summaries]
    if len(runs) > 1:
        rows += [("median", m) for m in medians(runs)]
    for label, s in rows:
        lines.append(
            f"| {label} | {s['mode']} | {s['surge_requests']} | {s['failed']} | "
            f"{s['surge_ttft_p50_ms']:.0f} / {s['surge_ttft_p99_ms']:.0f} | "
            f"{s['surge_cold']:.0f} ({s['surge_cold_ttft_p50_ms']:.0f}) | "
            f"{s['surge_workers']:.0f} | {s['base_ttft_p99_ms']:.0f} | "
            f"{s['prewarms_sent']:.0f} / {s['prewarms_placed']:.0f} |")
    return "\n".join(lines) + "\n"


def medians(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per mode, each field's median over the repeats; failures of all repeats summed."""
    out = []
    for first in runs[0]:
        rows = [next(s for s in summaries if s["mode"] == first["mode"]) for summaries in runs]
        merged: dict[str, Any] = {
            "mode": first["mode"], "surge_requests": sum(r["surge_requests"] for r in rows),
            "failed": sum(r["failed"] for r in rows)}
        for name in FIELDS:
            values = [r[name] for r in rows if r[name] == r[name]]  # NaN: none of its kind
            merged[name] = statistics.median(values) if values else float("nan")
        out.append(merged)
    return out


def parse_args(argv: Sequence[str]) -> tuple[SurgeConfig, Path]:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_prewarm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SurgeConfig()
    for name in ("base_rate", "surge_from", "surge_to", "before_s", "ramp_s", "hold_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    for name in ("workers", "system_chars", "max_tokens", "tenants", "seed", "repeats"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--modes", default=",".join(d.modes), help=f"{', '.join(MODES)}")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag")
    p.add_argument("--gateway-from", action="append", default=[], metavar="LABEL=DIR",
                   help="one more mode: the gateway from the checkout in DIR")
    p.add_argument("--out", type=Path, default=Path("loadtest/out/prewarm"))
    a = p.parse_args(argv)
    sources = tuple((label, path) for label, _, path in
                    (v.partition("=") for v in a.gateway_from))
    if any(not label or not path or label in MODES for label, path in sources):
        p.error("--gateway-from takes LABEL=DIR, LABEL not one of the modes")
    modes = tuple(m for m in a.modes.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes {', '.join(MODES)}")
    modes += tuple(label for label, _ in sources)
    if a.repeats < 1 or a.workers < 2:
        p.error("--repeats must be >= 1 and --workers >= 2")
    if min(a.base_rate, a.surge_from, a.surge_to, a.before_s, a.ramp_s, a.hold_s) < 0:
        p.error("rates and durations must be >= 0")
    config = SurgeConfig(
        workers=a.workers, base_rate=a.base_rate, surge_from=a.surge_from,
        surge_to=a.surge_to, before_s=a.before_s, ramp_s=a.ramp_s, hold_s=a.hold_s,
        system_chars=a.system_chars, max_tokens=a.max_tokens, tenants=a.tenants, seed=a.seed,
        repeats=a.repeats, modes=modes, worker_args=tuple(a.worker_arg),
        gateway_args=tuple(a.gateway_arg), sources=sources)
    return config, a.out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config, out = parse_args(args)
    command = " ".join(["python -m loadtest.bench_prewarm", *args])
    runs: list[list[dict[str, Any]]] = []
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prewarm-") as logs:
        for i in range(config.repeats):
            with collector_paused():  # repeat i's load comes from seed + i
                results = asyncio.run(run(dataclasses.replace(config, seed=config.seed + i),
                                          Path(logs)))
            runs.append([summarize(r) for r in results])
            samples.append({r.mode: {"surge": [asdict(s) for s in r.surge],
                                     "base": [asdict(s) for s in r.base]} for r in results})
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(to_markdown(runs, config, command))
    (out / "report.json").write_text(json.dumps(
        {"config": asdict(config), "repeats": runs,
         "medians": medians(runs) if len(runs) > 1 else runs[0]}, indent=2, default=str))
    (out / "samples.json").write_text(json.dumps(samples))
    print((out / "report.md").read_text())
    return 0 if all(s["surge_requests"] for summaries in runs for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
