"""What reading a worker's ``/metrics`` page costs the gateway, per page and per probe.

``python -m loadtest.bench_metrics_page [--engines 1 4] [--histograms 12] [--repeat 300]
[--probes 500] [--spaced N --apart-s 5]``

Times :func:`gateway.backends.metrics_page.parse_engine_metrics` (the health loop calls it
once per worker each interval, on the event loop that relays requests) on the reference
worker's own page (a worker is started on loopback and asked one request first) and on
vLLM-shaped pages: per data-parallel engine, the gauges and counters the gateway reads, a few
it does not, and ``--histograms`` histograms of 20 buckets, every series labelled with the
model and the engine, each with its ``# HELP`` and ``# TYPE`` lines. Prints microseconds per
page, the median of five timings of ``--repeat`` reads, for a probe that reads the whole
server (``rank`` none) and one that reads engine 0. Then the whole probe the health loop makes
of that worker (``/health``, ``/v1/models``, ``/metrics`` and its reading, through the gateway's
OpenAI HTTP backend), ``--probes`` times in turn: this process's CPU per probe (the worker's is
its own process's), the median of five rounds; with ``--spaced N``, also N probes
``--apart-s`` seconds apart, as a health round spaces them (each finds its connection idle
that long).

The gateway on ``PYTHONPATH`` is the one timed, so an older checkout can be timed beside this
one (``PYTHONPATH=/path/to/checkout python loadtest/bench_metrics_page.py``; before the page
reader had its own module it lived in ``gateway.backends.openai_http``). A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

from gateway.backends.openai_http import OpenAIHTTPBackend
from gateway.routing.types import Worker
from infra.procs import free_port_block, start_server, stop_processes

Parse = Callable[[str, "int | None"], dict[str, float]]
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
           "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
           "vllm:prefix_cache_hits_total")
_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
               "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
               "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
               "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
               "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
               "vllm:request_params_n", "vllm:request_max_num_generation_tokens")


def page_reader() -> Parse:
    """``parse_engine_metrics`` of the gateway on the path (its module or, in checkouts from
    before it had one, the OpenAI HTTP backend's)."""
    for module in ("gateway.backends.metrics_page", "gateway.backends.openai_http"):
        try:
            found: Parse = importlib.import_module(module).parse_engine_metrics
        except (ImportError, AttributeError):
            continue
        return found
    raise SystemExit("no gateway page reader on the path")


def vllm_page(engines: int, histograms: int) -> str:
    """A page shaped like vLLM's for ``engines`` data-parallel engines of one model."""
    lines: list[str] = []
    for e in range(engines):
        labels = f'engine="{e}",model_name="meta-llama/Llama-3.1-8B-Instruct"'
        for name in _GAUGES:
            lines += [f"# HELP {name} {name[5:]}.", f"# TYPE {name} gauge",
                      f"{name}{{{labels}}} {e + 3}.0"]
        lines.append(f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",{labels},'
                     f'num_gpu_blocks="{20000 + e}"}} 1.0')
        for name in _HISTOGRAMS[:histograms] + _HISTOGRAMS[:max(0, histograms - 12)]:
            lines += [f"# HELP {name} {name[5:]}.", f"# TYPE {name} histogram"]
            lines += [f'{name}_bucket{{{labels},le="{b * 0.05:.2f}"}} {b * 7}.0'
                      for b in range(1, 20)]
            lines += [f'{name}_bucket{{{labels},le="+Inf"}} 140.0',
                      f"{name}_count{{{labels}}} 140.0", f"{name}_sum{{{labels}}} 12.5"]
    return "\n".join(lines) + "\n"


async def worker_page(probes: int, apart: tuple[int, float]) -> tuple[str, float, float]:
    """The reference worker's page after one request, and this process's CPU ms per probe of
    the worker by the gateway's backend: probes in turn (the median of five rounds of
    ``probes``) and probes spaced (``apart``: how many, how many seconds apart; 0: none)."""
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            await start_server([sys.executable, "-m", "worker", "--host", "127.0.0.1",
                                "--port", str(port), "--model", "m"], url,
                               Path(logs) / "worker.log", procs)
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions", json={
                        "model": "m", "prompt": "hello " * 50, "max_tokens": 2}) as r:
                    await r.read()
                async with session.get(url + "/metrics") as r:
                    page = await r.text()
            worker = Worker(f"127.0.0.1:{port}", url)
            spaced = await probe_ms(worker, apart[0], apart[1]) if apart[0] else math.nan
            return page, await probe_ms(worker, probes), spaced
        finally:
            await stop_processes(procs)


async def probe_ms(worker: Worker, probes: int, apart_s: float = 0.0) -> float:
    """CPU ms per probe: the median of five rounds of ``probes``, or (``apart_s`` > 0) of
    ``probes`` probes that many seconds apart (as a health round spaces them, each finding its
    connection idle as long)."""
    backend = OpenAIHTTPBackend(connect_timeout_s=5.0, read_timeout_s=30.0, max_connections=64,
                                max_connections_per_worker=8)
    await backend.start()
    rounds = []
    try:
        for _ in range(1 if apart_s else 5):
            spent = 0.0
            for _ in range(probes):
                if apart_s:
                    await asyncio.sleep(apart_s)
                started = time.process_time()
                probe = await backend.probe(worker)
                spent += time.process_time() - started
                if not probe.healthy:
                    raise SystemExit(f"the worker failed a probe: {probe.error}")
            rounds.append(spent / probes * 1e3)
    finally:
        await backend.close()
    return statistics.median(rounds)


def per_page_us(parse: Parse, page: str, rank: int | None, repeat: int) -> float:
    runs = timeit.repeat(lambda: parse(page, rank), number=repeat, repeat=5)
    return statistics.median(runs) / repeat * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_metrics_page",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, nargs="+", default=[1, 4])
    p.add_argument("--histograms", type=int, default=12)
    p.add_argument("--repeat", type=int, default=300, help="reads per timing")
    p.add_argument("--probes", type=int, default=500, help="probes per round")
    p.add_argument("--spaced", type=int, default=0, metavar="N",
                   help="also N probes --apart-s seconds apart (0: none)")
    p.add_argument("--apart-s", type=float, default=5.0,
                   help="seconds between spaced probes (a health interval)")
    args = p.parse_args(argv)
    parse = page_reader()
    own, probe_cpu_ms, spaced_ms = asyncio.run(
        worker_page(args.probes, (args.spaced, args.apart_s)))
    pages = [("reference worker", own)]
    pages += [(f"vLLM-shaped, {n} engine(s)", vllm_page(n, args.histograms))
              for n in args.engines]
    print(f"page reader: {parse.__module__}.{parse.__name__}\n")
    print("| page | bytes | lines | us per read, whole server | us per read, engine 0 |")
    print("|---|---:|---:|---:|---:|")
    for label, page in pages:
        print(f"| {label} | {len(page):,} | {page.count(chr(10)):,} | "
              f"{per_page_us(parse, page, None, args.repeat):.1f} | "
              f"{per_page_us(parse, page, 0, args.repeat):.1f} |")
    print(f"\nA whole probe of the reference worker: {probe_cpu_ms:.3f} ms of CPU")
    if args.spaced:
        print(f"Probes {args.apart_s:g} s apart ({args.spaced}): {spaced_ms:.3f} ms of CPU each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
