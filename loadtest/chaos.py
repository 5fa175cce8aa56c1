"""Fault catalogue: ``python -m loadtest chaos [--workers 4] [--concurrency 8] [--only NAME]
[--gateway-args='--max-inflight 64'] [--worker-args='--max-running 16'] [--json] [--out FILE]``.

For each fault, a fresh cluster of real processes on loopback (``redis-server``, self-registering
reference workers, one gateway on the store; see :mod:`loadtest.chaos_load`), a steady
closed-loop load (half the clients streaming), the fault injected ``--warm-s`` seconds in, and
``--observe-s`` seconds more of load. Bounded: every run stops by itself.

``--gateway-args`` and ``--worker-args`` (repeatable, split like a shell line) are passed to
every gateway and worker process as they are, after the harness's own flags.

Per fault: requests sent; failed, non-streaming and streaming (a stream fails when it carries
an error event or misses its ``[DONE]``); retried (the gateway's ``gateway_retries_total``);
seconds to recover (from the fault to the end of the last request that failed or took more
than ``max(1 s, 5 x`` the median before the fault), 0 when none did); for the drains, requests
in flight at the signal that failed (dropped); for the SIGSTOP mid-stream fault, how the long
streams relaying from the stopped worker ended (the gateway's stream idle timeout, 2 s here);
for the abort burst, the tokens the workers
generated in the 2 s that start 1 s after the clients left, or later once the steady
load (paused when they leave) has no request in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from loadtest.bench_gateway import MODEL, emit
from loadtest.chaos_load import ChaosCluster, Load, Sample, abort_burst, scrape


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    workers: int = 4
    concurrency: int = 8
    max_tokens: int = 24
    warm_s: float = 3.0
    observe_s: float = 8.0
    abort_clients: int = 500
    first_byte_timeout_s: float = 0.0
    stream_idle_timeout_s: float = 2.0
    health_interval_s: float = 1.0
    connect_timeout_s: float = 10.0
    only: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()  # extra flags for every gateway process
    worker_args: tuple[str, ...] = ()  # extra flags for every worker process


@dataclass(slots=True)
class FaultResult:
    fault: str
    sent: int = 0
    failed: int = 0
    failed_streams: int = 0
    retried: int = 0
    recover_s: float = 0.0
    dropped_inflight: int | None = None
    aborted_tokens_after_1s: int | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Ctx:
    config: ChaosConfig
    cluster: ChaosCluster
    load: Load
    session: aiohttp.ClientSession
    result: FaultResult
    fault_at: float = 0.0


Inject = Callable[[Ctx], Awaitable[None]]


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


# -- the faults ----------------------------------------------------------------------------


async def worker_kill(ctx: Ctx) -> None:
    ctx.cluster.signal_worker(0, signal.SIGKILL)


async def worker_stop(ctx: Ctx) -> None:
    ctx.cluster.signal_worker(0, signal.SIGSTOP)
    await asyncio.sleep(5.0)
    ctx.cluster.signal_worker(0, signal.SIGCONT)
    ctx.result.notes.append("SIGCONT after 5 s")


async def worker_stop_mid_stream(ctx: Ctx) -> None:
    """Long streams that are relaying from a worker when it is stopped: each should end with
    the gateway's stream idle timeout (an SSE error event), not wait for the read timeout."""
    ids = [url.removeprefix("http://") for url in ctx.cluster.worker_urls]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        wid, streams = await streams_on_one_worker(http, ctx.cluster.gateway, want=2)
        victim = ids.index(wid) if wid in ids else 0
        ctx.cluster.signal_worker(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            ends = await asyncio.gather(*(_stream_end(r, stopped) for r in streams))
        finally:
            ctx.cluster.signal_worker(victim, signal.SIGCONT)
    described = ", ".join(f"{how} after {seconds:.1f} s" for seconds, how in ends)
    ctx.result.notes.append(f"{len(streams)} streams relaying from the stopped worker: "
                            f"{described or 'none found'}; SIGCONT then")


async def streams_on_one_worker(
    http: aiohttp.ClientSession, gateway: str, want: int, tries: int = 32
) -> tuple[str, list[aiohttp.ClientResponse]]:
    """``want`` long streams (fewer if ``tries`` run out) that the gateway routed to one
    worker, each with its first bytes received; the worker's id. Others are dropped."""
    by_worker: dict[str, list[aiohttp.ClientResponse]] = {}
    for k in range(tries):
        body = {"model": MODEL, "max_tokens": 4000, "stream": True,
                "messages": [{"role": "user", "content": f"a long story, number {k}"}]}
        response = await http.post(gateway + "/v1/chat/completions", json=body)
        wid = response.headers.get("x-route-worker", "")
        if response.status == 200 and wid and await response.content.readany():
            by_worker.setdefault(wid, []).append(response)
            if len(by_worker[wid]) == want:
                break
        else:
            response.close()
    wid, held = max(by_worker.items(), key=lambda kv: len(kv[1]), default=("", []))
    for other in by_worker.values():
        if other is not held:
            for response in other:
                response.close()
    return wid, held


async def _stream_end(response: aiohttp.ClientResponse, since: float) -> tuple[float, str]:
    """Seconds from ``since`` until the stream ended, and how: the error code of its last
    event, "[DONE]", or "still open" after 30 s."""
    rest = b""
    try:
        async with asyncio.timeout(30.0):
            rest = await response.content.read()
    except TimeoutError:
        return time.monotonic() - since, "still open"
    except aiohttp.ClientError as exc:
        return time.monotonic() - since, type(exc).__name__
    finally:
        response.close()
    last = rest.rstrip().rsplit(b"data: ", 1)[-1]
    try:
        how = str(json.loads(last)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        how = last.decode("utf-8", "replace")[:40]
    return time.monotonic() - since, how


async def redis_kill(ctx: Ctx) -> None:
    proc = ctx.cluster.signal_redis(signal.SIGKILL)
    await proc.wait()
    await asyncio.sleep(3.0)
    await ctx.cluster.start_redis()
    ctx.result.notes.append("restarted empty after 3 s")


async def redis_restart(ctx: Ctx) -> None:
    proc = ctx.cluster.signal_redis(signal.SIGTERM)
    await proc.wait()
    await ctx.cluster.start_redis()
    ctx.result.notes.append("restarted empty at once")


async def redis_flushall(ctx: Ctx) -> None:
    await ctx.cluster.flushall()


async def redis_stop(ctx: Ctx) -> None:
    ctx.cluster.signal_redis(signal.SIGSTOP)
    await asyncio.sleep(3.0)
    ctx.cluster.signal_redis(signal.SIGCONT)
    ctx.result.notes.append("SIGCONT after 3 s")


async def gateway_restart(ctx: Ctx) -> None:
    proc = ctx.cluster.signal_gateway(signal.SIGKILL)
    await proc.wait()
    await ctx.cluster.start_gateway()
    ctx.result.notes.append(await _index_note(ctx))


async def _index_note(ctx: Ctx) -> str:
    try:
        async with ctx.session.get(ctx.cluster.gateway + "/admin/workers") as response:
            blocks = int((await response.json())["index_blocks"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return "index size unknown after restart"
    return f"index rebuilt with {blocks} blocks at start"


def dropped_in_flight(samples: Sequence[Sample], at: float) -> int:
    return sum(1 for s in samples if s.start < at < s.end and not s.ok)


async def worker_drain(ctx: Ctx) -> None:
    ctx.cluster.signal_worker(0, signal.SIGTERM)
    await ctx.cluster.worker_procs[0].wait()
    ctx.result.notes.append("worker exited after draining")


async def gateway_drain(ctx: Ctx) -> None:
    proc = ctx.cluster.signal_gateway(signal.SIGTERM)
    await proc.wait()
    ctx.result.notes.append(f"gateway exited with {proc.returncode}; started again")
    await ctx.cluster.start_gateway()


async def abort_clients(ctx: Ctx) -> None:
    config = ctx.config
    held, started = await abort_burst(
        ctx.cluster.gateway, ctx.cluster.worker_urls, config.abort_clients, 2000
    )
    left = time.monotonic()
    # From here on the steady load sends nothing; once its last requests are done, only the
    # aborted requests could still make the workers generate.
    ctx.load.pause()
    await ctx.load.drained(10.0)
    drained_s = time.monotonic() - left
    await _sleep_until(left + 1.0)
    before = await _generated(ctx)
    await asyncio.sleep(2.0)
    after = await _generated(ctx)
    ctx.load.resume()
    aborted = 0.0
    for url in ctx.cluster.worker_urls:
        aborted += (await scrape(ctx.session, url)).get("worker_requests_aborted_total", 0.0)
    ctx.result.aborted_tokens_after_1s = int(after - before)
    ctx.result.notes.append(
        f"{config.abort_clients} streams (2,000 tokens each) dropped together once the workers "
        f"held {held} requests, {started} of them streaming; the workers counted "
        f"{int(aborted)} aborted; window from {max(1.0, drained_s):.1f} s"
    )


async def _generated(ctx: Ctx) -> float:
    total = 0.0
    for url in ctx.cluster.worker_urls:
        total += (await scrape(ctx.session, url)).get("vllm:generation_tokens_total", 0.0)
    return total


FAULTS: dict[str, Inject] = {
    "worker kill -9": worker_kill,
    "worker SIGSTOP": worker_stop,
    "worker SIGSTOP mid-stream": worker_stop_mid_stream,
    "redis kill -9": redis_kill,
    "redis restart": redis_restart,
    "redis FLUSHALL": redis_flushall,
    "redis SIGSTOP": redis_stop,
    "gateway restart (kill -9)": gateway_restart,
    "worker SIGTERM drain": worker_drain,
    "gateway SIGTERM drain": gateway_drain,
    "500 clients abort": abort_clients,
}
_DRAINS = {"worker SIGTERM drain", "gateway SIGTERM drain"}


# -- one run -------------------------------------------------------------------------------


def failure_notes(samples: Sequence[Sample]) -> list[str]:
    """What the failed requests saw, most frequent first (``HTTP 503 x4, stream error event
    x1``); nothing when none failed."""
    seen = Counter(s.error or "no answer" for s in samples if not s.ok)
    if not seen:
        return []
    return ["failures: " + ", ".join(f"{error} x{n}" for error, n in seen.most_common())]


def recover_seconds(samples: Sequence[Sample], fault_at: float) -> float:
    before = [s.end - s.start for s in samples if s.end < fault_at and s.ok]
    slow = max(1.0, 5 * statistics.median(before)) if before else 1.0
    disturbed = [s.end for s in samples
                 if s.end >= fault_at and (not s.ok or s.end - s.start > slow)]
    return max(disturbed) - fault_at if disturbed else 0.0


async def run_fault(config: ChaosConfig, name: str) -> FaultResult:
    result = FaultResult(name)
    gateway_args = (
        "--first-byte-timeout-s", str(config.first_byte_timeout_s),
        "--stream-idle-timeout-s", str(config.stream_idle_timeout_s),
        "--health-interval-s", str(config.health_interval_s),
        "--connect-timeout-s", str(config.connect_timeout_s),
        # Room for the abort burst: hundreds of open streams on one worker of a hot prefix.
        "--max-connections-per-worker", str(max(256, config.abort_clients + 64)),
        *config.gateway_args,
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        cluster = await _started_cluster(config, gateway_args, session)
        try:
            load = Load(cluster.gateway, config.concurrency, config.max_tokens)
            await load.start()
            ctx = Ctx(config, cluster, load, session, result)
            await asyncio.sleep(config.warm_s)
            retries_before = (await scrape(session, cluster.gateway)).get(
                "gateway_retries_total", 0.0)
            gateway_pid = cluster.gateway_procs[-1].pid
            ctx.fault_at = time.monotonic()
            await FAULTS[name](ctx)
            await _sleep_until(ctx.fault_at + config.observe_s)
            await load.stop()
            retries_after = (await scrape(session, cluster.gateway)).get(
                "gateway_retries_total", 0.0)
            same_gateway = cluster.gateway_procs[-1].pid == gateway_pid
            result.retried = int(retries_after - (retries_before if same_gateway else 0.0))
            samples = load.samples
            result.sent = len(samples)
            result.failed = sum(1 for s in samples if not s.ok and not s.stream)
            result.failed_streams = sum(1 for s in samples if not s.ok and s.stream)
            result.recover_s = round(recover_seconds(samples, ctx.fault_at), 2)
            if name in _DRAINS:
                result.dropped_inflight = dropped_in_flight(samples, ctx.fault_at)
            result.notes.extend(failure_notes(samples))
            errors = await asyncio.to_thread(cluster.logged_errors)
            if errors:
                result.notes.append(f"ERROR lines logged: {errors} (logs in {cluster.logs})")
        finally:
            await cluster.stop()
    return result


async def _started_cluster(
    config: ChaosConfig, gateway_args: tuple[str, ...], session: aiohttp.ClientSession
) -> ChaosCluster:
    """A started cluster; a start that fails (a port taken meanwhile by another program) is
    retried on fresh ports, twice."""
    for attempt in range(3):
        cluster = ChaosCluster(config.workers, gateway_args, config.worker_args)
        try:
            await cluster.start(session)
        except (RuntimeError, TimeoutError) as exc:
            await cluster.stop()
            if attempt == 2:
                raise
            print(f"chaos: cluster did not start ({str(exc).splitlines()[0]}); retrying",
                  file=sys.stderr, flush=True)
        else:
            return cluster
    raise AssertionError("unreachable")


async def run_all(config: ChaosConfig) -> list[FaultResult]:
    names = [n for n in FAULTS if not config.only or n in config.only]
    results = []
    for name in names:
        print(f"chaos: {name} ...", file=sys.stderr, flush=True)
        results.append(await run_fault(config, name))
    return results


# -- report --------------------------------------------------------------------------------


def to_markdown(results: Sequence[FaultResult], config: ChaosConfig, command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        f"{config.workers} workers (simulated engine), 1 gateway with `--first-byte-timeout-s "
        f"{config.first_byte_timeout_s:g} --stream-idle-timeout-s "
        f"{config.stream_idle_timeout_s:g} --health-interval-s {config.health_interval_s:g} "
        f"--connect-timeout-s {config.connect_timeout_s:g} --max-connections-per-worker "
        f"{max(256, config.abort_clients + 64)}{_extra(config.gateway_args)}`"
        f"{', workers with `' + shlex.join(config.worker_args) + '`' if config.worker_args else ''}"
        f", Redis; {config.concurrency} closed-loop clients "
        f"(half streaming, max_tokens {config.max_tokens}); fault at {config.warm_s:g} s, "
        f"{config.observe_s:g} s observed after it.",
        "",
        "| fault | sent | failed (non-stream) | failed (stream) | retried | recover s "
        "| dropped in flight | tokens > 1 s after abort | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        dropped = "" if r.dropped_inflight is None else str(r.dropped_inflight)
        tokens = "" if r.aborted_tokens_after_1s is None else str(r.aborted_tokens_after_1s)
        lines.append(
            f"| {r.fault} | {r.sent} | {r.failed} | {r.failed_streams} | {r.retried} "
            f"| {r.recover_s:.2f} | {dropped} | {tokens} | {'; '.join(r.notes)} |"
        )
    return "\n".join(lines) + "\n"


def _extra(args: Sequence[str]) -> str:
    return " " + shlex.join(args) if args else ""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest chaos", description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--warm-s", type=float, default=3.0)
    parser.add_argument("--observe-s", type=float, default=8.0)
    parser.add_argument("--abort-clients", type=int, default=500)
    parser.add_argument("--first-byte-timeout-s", type=float, default=0.0,
                        help="the gateway's; 0 (its default): hung workers are found by probes")
    parser.add_argument("--stream-idle-timeout-s", type=float, default=2.0,
                        help="the gateway's (its default is 60 s; short here to fit the run)")
    parser.add_argument("--health-interval-s", type=float, default=1.0)
    parser.add_argument("--connect-timeout-s", type=float, default=10.0)
    parser.add_argument("--only", action="append", default=[], choices=list(FAULTS),
                        help="run only this fault (repeatable)")
    parser.add_argument("--gateway-args", action="append", default=[], metavar="'FLAGS'",
                        help="more flags for every gateway process, split like a shell line "
                             "(repeatable; write --gateway-args='--max-inflight 64')")
    parser.add_argument("--worker-args", action="append", default=[], metavar="'FLAGS'",
                        help="more flags for every worker process, split like a shell line "
                             "(repeatable)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(
        workers=args.workers, concurrency=args.concurrency, max_tokens=args.max_tokens,
        warm_s=args.warm_s, observe_s=args.observe_s, abort_clients=args.abort_clients,
        first_byte_timeout_s=args.first_byte_timeout_s,
        stream_idle_timeout_s=args.stream_idle_timeout_s,
        health_interval_s=args.health_interval_s, connect_timeout_s=args.connect_timeout_s,
        only=tuple(args.only),
        gateway_args=tuple(a for line in args.gateway_args for a in shlex.split(line)),
        worker_args=tuple(a for line in args.worker_args for a in shlex.split(line)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    config = config_from(args)
    results = asyncio.run(run_all(config))
    command = shlex.join(["python", "-m", "loadtest", "chaos", *args_list])
    emit(to_markdown(results, config, command),
         json.dumps([asdict(r) for r in results], indent=2), args.out, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
