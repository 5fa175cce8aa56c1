"""guidellm against the gateway and the peer routers, in front of the same reference workers.

``python -m loadtest.guidellm_bench --guidellm PATH [--requests 400] [--json]``

guidellm (the benchmark client vLLM users run) is a benchmark-only tool that pulls in torch: it
is never a dependency of this project. Install it into a separate virtualenv
(``python -m venv /work/guidellm-venv && /work/guidellm-venv/bin/pip install guidellm==0.8.1``)
and pass its executable with ``--guidellm``.

Setup (the same for every router): 4 reference workers (``--prefill-us-per-token 100``, 1,024
cache blocks of 16 tokens, the other costs at the worker's defaults) that tokenize with a small
byte-level BPE tokenizer built here from a fixed word list (no download); guidellm counts tokens
with the same tokenizer. guidellm's synthetic data: 16 shared prefixes of 2,000 tokens, 200
unique prompt tokens, 32 output tokens, 16 concurrent streams, ``--requests`` requests per
router. Routers in turn, each after a cache flush: the gateway with its default policy and with
round_robin, then sglang-router and smg (cache_aware). Reported: TTFT p50 / p95 (ms) and
requests/s from guidellm's JSON, plus the workers' block hit rate (``/stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from gateway.settings import GatewaySettings
from infra.procs import free_port_block
from loadtest.harness import MODEL, histogram_totals
from loadtest.peers import PEERS, PeerUnavailableError, running_peer
from loadtest.replay import Fleet, ReplayConfig, gateway_running
from loadtest.workloads import VOCABULARY


def build_tokenizer(directory: Path, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer (HF ``tokenizers`` JSON + config) trained on seeded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(VOCABULARY) for _ in range(200)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000}))
    return directory / "tokenizer.json"


def guidellm_command(binary: str, target: str, tokenizer_dir: Path, requests: int,
                     out: Path) -> list[str]:
    return [
        binary, "run",
        "--backend", f"kind=openai_http,target={target},model={MODEL}",
        "--profile", "kind=concurrent,streams=16",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", "kind=synthetic_text,prompt_tokens=200,output_tokens=32,prefix_tokens=2000,"
                  "prefix_count=16",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]


def read_result(path: Path) -> dict[str, float]:
    bench = json.loads(path.read_text())["benchmarks"][0]["metrics"]
    ttft = bench["time_to_first_token_ms"]["successful"]
    return {
        "ttft_p50_ms": float(ttft["percentiles"]["p50"]),
        "ttft_p95_ms": float(ttft["percentiles"]["p95"]),
        "requests_per_s": float(bench["requests_per_second"]["successful"]["mean"]),
        "completed": float(bench["request_totals"]["successful"]),
        "errored": float(bench["request_totals"]["errored"]),
    }


async def worker_hits(urls: Sequence[str]) -> tuple[int, int, list[int], float, int]:
    """The workers' prompt tokens looked up and found cached, summed; each worker's finished
    requests (from ``/stats``); and their time to first token, summed over requests, with the
    count (``vllm:time_to_first_token_seconds`` from ``/metrics``)."""
    queries = hits = ttft_count = 0
    ttft_sum = 0.0
    finished: list[int] = []
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/stats") as response:
                stats = await response.json()
            queries += int(stats["cache"]["queries_tokens"])
            hits += int(stats["cache"]["hit_tokens"])
            finished.append(int(stats["requests_finished"]))
            async with session.get(url + "/metrics") as response:
                seconds, count = histogram_totals(await response.text(),
                                                  "vllm:time_to_first_token_seconds")
            ttft_sum += seconds
            ttft_count += count
    return queries, hits, finished, ttft_sum, ttft_count


async def run_guidellm(binary: str, target: str, tokenizer_dir: Path, requests: int,
                       logs: Path, name: str) -> dict[str, float]:
    out = logs / f"{name}.json"
    log = logs / f"{name}.log"
    with log.open("wb") as fh:
        proc = await asyncio.create_subprocess_exec(
            *guidellm_command(binary, target, tokenizer_dir, requests, out),
            stdin=asyncio.subprocess.DEVNULL, stdout=fh, stderr=fh)
        code = await proc.wait()
    if code != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {code}:\n{log.read_text()[-2000:]}")
    return read_result(out)


async def bench(binary: str, requests: int, routers: Sequence[str]) -> list[dict[str, Any]]:
    logs = Path(tempfile.mkdtemp(prefix="guidellm-"))
    rows: list[dict[str, Any]] = []
    try:
        tok_file = build_tokenizer(logs / "tokenizer")
        config = ReplayConfig(workers=4, cache_blocks=1024, prefill_us_per_token=100.0,
                              cached_us_per_token=5.0, decode_ms_per_token=5.0, max_running=8,
                              extra_worker_args=("--tokenizer-file", str(tok_file)))
        fleet = Fleet(config, free_port_block(5), logs)
        async with fleet.running():
            for router in routers:
                async with aiohttp.ClientSession() as session:
                    await fleet.flush(session)
                before = await worker_hits(fleet.urls)
                print(f"[guidellm] {router} ...", file=sys.stderr, flush=True)
                if router.startswith("ours:"):
                    async with gateway_running(fleet, router[5:]) as (url, _):
                        row = await run_guidellm(binary, url, tok_file.parent, requests, logs,
                                                 router.replace(":", "-"))
                else:
                    async with running_peer(router, fleet.urls, logs) as peer:
                        row = await run_guidellm(binary, peer.url, tok_file.parent, requests,
                                                 logs, router)
                after = await worker_hits(fleet.urls)
                queries = after[0] - before[0]
                hit = (after[1] - before[1]) / queries if queries else 0.0
                served = [a - b for a, b in zip(after[2], before[2], strict=True)]
                counted = after[4] - before[4]
                worker_ttft = (after[3] - before[3]) / counted * 1e3 if counted else 0.0
                rows.append({"router": router, **row, "token_hit_rate": hit,
                             "worker_requests": served, "worker_ttft_mean_ms": worker_ttft})
                print(f"[guidellm] {router}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m loadtest.guidellm_bench", description=__doc__)
    p.add_argument("--guidellm", required=True, help="the guidellm executable (its own venv)")
    p.add_argument("--requests", type=int, default=400, help="requests per router")
    p.add_argument("--no-peers", action="store_true", help="only the gateway")
    p.add_argument("--routers", default="",
                   help="comma list instead of the default set (ours:POLICY, sglang-router, smg)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(args_list)
    routers = [f"ours:{GatewaySettings().policy}", "ours:round_robin"]
    if not args.no_peers:
        routers += list(PEERS)
    if args.routers:
        routers = [r for r in args.routers.split(",") if r]
    try:
        rows = asyncio.run(bench(args.guidellm, args.requests, routers))
    except (RuntimeError, OSError, PeerUnavailableError, aiohttp.ClientError) as exc:
        print(f"guidellm_bench: {exc}", file=sys.stderr)
        return 1
    command = shlex.join(["python", "-m", "loadtest.guidellm_bench", *args_list])
    if args.json:
        print(json.dumps({"command": command, "rows": rows}, indent=2))
        return 0
    print(f"```\n{command}\n```\n")
    print("| router | TTFT p50 ms | TTFT p95 ms | requests/s | token hit rate | errored | "
          "workers' mean TTFT ms | requests per worker |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['router']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | "
              f"{r['requests_per_s']:.1f} | {r['token_hit_rate']:.3f} | {r['errored']:.0f} | "
              f"{r['worker_ttft_mean_ms']:.1f} | {', '.join(map(str, r['worker_requests']))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
