"""Benchmark: engine-exact routing (KV events) against the modelled index, on live workers.

``python -m loadtest.bench_exact [--workers 4] [--requests 240] [--cache-blocks 384] [--out F]``

Reference workers run as child processes with a locally trained tokenizer
(:mod:`loadtest.tiny_tokenizer`) and publish their KV events (``--kv-events``, ``--kv-replay``);
every mode gets fresh workers with the same settings and replays the same seeded workloads
(:mod:`loadtest.workloads`: tenants, chat, rag, fewshot) through the gateway:

* ``hybrid``: ``--tokenizer-file`` and the workers' event endpoints (``#kv-events=...``):
  the modelled LRU corrected by the events (the gateway's default view);
* ``events``: the same, with ``--kv-events-view events`` (the events alone);
* ``model-tokens``: ``--tokenizer-file``, no events: the modelled LRU over token-block keys;
* ``model-chars``: neither (the character fingerprint and modelled LRU; the default gateway).

Reported per mode and workload: hit rate (sum of ``x-cache-matched-tokens`` / sum of
``x-cache-input-tokens``) and the share of responses whose cached tokens the gateway predicted
exactly (``/admin/workers`` ``predictions``). Two disturbances follow, each in every mode: a
worker restarted halfway through the chat workload (its cache is gone; only events say so at
once), and two gateways without a shared store sending alternately to the same workers (each
models only its own decisions; events show both). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from infra.procs import PortLedger, start_server, stop_processes
from loadtest.harness import wait_all_workers_up
from loadtest.tiny_tokenizer import train
from loadtest.workloads import LiveRequest, LiveSpec, user_requests

MODES = ("hybrid", "events", "model-tokens", "model-chars")
EVENTED = ("hybrid", "events")
WORKLOADS = ("tenants", "chat", "rag", "fewshot")
MODEL = "sim-model"
_USERS = 16


@dataclass
class Tally:
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    matched_tokens: int = 0
    responses: int = 0  # responses the gateway counted a prediction for
    exact: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def exact_share(self) -> float:
        return self.exact / self.responses if self.responses else 0.0


@dataclass
class Cluster:
    workers: list[str]  # base URLs
    events: list[str]  # '#kv-events=...' fragments, one per worker
    gateways: list[str] = field(default_factory=list)
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    worker_cmds: list[list[str]] = field(default_factory=list)
    worker_procs: list[asyncio.subprocess.Process] = field(default_factory=list)


@contextlib.asynccontextmanager
async def cluster(mode: str, args: argparse.Namespace, tok: Path, logs: Path,
                  gateways: int = 1) -> AsyncIterator[Cluster]:
    c = Cluster([], [])
    ports = PortLedger()
    try:
        for i in range(args.workers):
            port, ev, rp = ports.take(), ports.take(), ports.take()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "worker", "--port", str(port), "--model", MODEL,
                   "--tokenizer-file", str(tok), "--cache-blocks", str(args.cache_blocks),
                   "--prefill-us-per-token", "5", "--prefill-us-per-cached-token", "0.5",
                   "--decode-ms-per-token", "0.5",
                   "--kv-events", f"tcp://127.0.0.1:{ev}", "--kv-replay", f"tcp://127.0.0.1:{rp}"]
            await start_server(cmd, url, logs / f"{mode}-w{i}.log", c.procs)
            c.worker_procs.append(c.procs[-1])
            c.workers.append(url)
            c.events.append(f"#kv-events=tcp://127.0.0.1:{ev}&kv-replay=tcp://127.0.0.1:{rp}")
            c.worker_cmds.append(cmd)
        for g in range(gateways):
            port = ports.take()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "gateway", "--port", str(port),
                   "--health-interval-s", "0.5"]
            if mode != "model-chars":
                cmd += ["--tokenizer-file", str(tok)]
            for w, frag in zip(c.workers, c.events, strict=True):
                cmd += ["--worker", w + (frag if mode in EVENTED else "")]
            if mode in EVENTED:
                cmd += ["--kv-events-view", mode]
            await start_server(cmd, url, logs / f"{mode}-g{g}.log", c.procs)
            c.gateways.append(url)
        yield c
    finally:
        await stop_processes(c.procs, grace_s=10)


async def admin(session: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with session.get(gateway + "/admin/workers") as r:
        data: dict[str, Any] = await r.json()
        return data


async def predictions(session: aiohttp.ClientSession, gateways: Sequence[str]) -> tuple[int, int]:
    responses = exact = 0
    for g in gateways:
        for w in (await admin(session, g))["workers"]:
            responses += w["predictions"]["responses"]
            exact += w["predictions"]["exact"]
    return responses, exact


async def ready(session: aiohttp.ClientSession, c: Cluster, mode: str) -> None:
    for g in c.gateways:
        await wait_all_workers_up(session, g, len(c.workers))
        if mode not in EVENTED:
            continue
        deadline = time.monotonic() + 30
        while sum(w["cache_source"] == "events"
                  for w in (await admin(session, g))["workers"]) < len(c.workers):
            if time.monotonic() > deadline:
                raise TimeoutError("event feeds did not go live")
            await asyncio.sleep(0.1)


def requests_for(workload: str, count: int, seed: int) -> list[LiveRequest]:
    spec = LiveSpec(seed=seed, model=MODEL, max_tokens=4, stream=False)
    users = [user_requests(workload, spec, u) for u in range(_USERS)]
    return [next(users[i % len(users)]) for i in range(count)]


async def send(session: aiohttp.ClientSession, gateway: str, req: LiveRequest,
               tally: Tally) -> None:
    headers = {"Authorization": f"Bearer {req.api_key}"} if req.api_key else {}
    try:
        async with session.post(gateway + req.path, json=req.body, headers=headers) as r:
            await r.read()
            tally.requests += 1
            if r.status != 200:
                tally.errors += 1
                return
            tally.input_tokens += int(r.headers.get("x-cache-input-tokens", "0"))
            tally.matched_tokens += int(r.headers.get("x-cache-matched-tokens", "0"))
    except (aiohttp.ClientError, TimeoutError):
        tally.requests += 1
        tally.errors += 1


async def replay(session: aiohttp.ClientSession, c: Cluster, reqs: Sequence[LiveRequest],
                 concurrency: int) -> Tally:
    """Send ``reqs`` (alternating between the gateways) with ``concurrency`` in flight."""
    tally = Tally()
    before = await predictions(session, c.gateways)
    queue = iter(enumerate(reqs))

    async def user() -> None:
        # Request i is user i % 16's next turn: with two gateways, turns alternate between them.
        for i, req in queue:
            await send(session, c.gateways[i // _USERS % len(c.gateways)], req, tally)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    after = await predictions(session, c.gateways)
    tally.responses, tally.exact = after[0] - before[0], after[1] - before[1]
    return tally


async def restart_worker(c: Cluster, index: int, logs: Path) -> None:
    """Stop worker ``index`` and start it again on the same ports (an empty cache)."""
    proc = c.worker_procs[index]
    await stop_processes([proc], grace_s=10)
    c.procs.remove(proc)
    await start_server(c.worker_cmds[index], c.workers[index], logs / f"restart-w{index}.log",
                       c.procs)
    c.worker_procs[index] = c.procs[-1]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"workloads": {}, "restart": {}, "two_gateways": {}}
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as tmp:
        logs = Path(tmp)
        tok = train(logs / "tokenizer.json")
        timeout = aiohttp.ClientTimeout(total=60)
        for mode in args.modes:
            async with cluster(mode, args, tok, logs) as c, aiohttp.ClientSession(
                timeout=timeout
            ) as s:
                await ready(s, c, mode)
                for workload in args.workloads:
                    reqs = requests_for(workload, args.requests, args.seed)
                    t = await replay(s, c, reqs, args.concurrency)
                    out["workloads"].setdefault(workload, {})[mode] = t
                    print(f"{mode:13} {workload:8} hit {t.hit_rate:.3f} exact "
                          f"{t.exact_share:.4f} ({t.exact}/{t.responses}) errors {t.errors}",
                          file=sys.stderr, flush=True)
            async with cluster(mode, args, tok, logs) as c, aiohttp.ClientSession(
                timeout=timeout
            ) as s:
                await ready(s, c, mode)
                reqs = requests_for("chat", args.requests, args.seed + 1)
                half = len(reqs) // 2
                first = await replay(s, c, reqs[:half], args.concurrency)
                await restart_worker(c, 0, logs)
                await ready(s, c, mode)
                second = await replay(s, c, reqs[half:], args.concurrency)
                out["restart"][mode] = (first, second)
                print(f"{mode:13} restart  before exact {first.exact_share:.4f} after "
                      f"{second.exact_share:.4f} hit {second.hit_rate:.3f}", file=sys.stderr,
                      flush=True)
            async with cluster(mode, args, tok, logs, gateways=2) as c, aiohttp.ClientSession(
                timeout=timeout
            ) as s:
                await ready(s, c, mode)
                reqs = requests_for("chat", args.requests, args.seed + 2)
                t = await replay(s, c, reqs, args.concurrency)
                out["two_gateways"][mode] = t
                print(f"{mode:13} 2 gateways exact {t.exact_share:.4f} hit {t.hit_rate:.3f}",
                      file=sys.stderr, flush=True)
    return out


async def tokenize_cost(tok: Path, rounds: int = 40) -> str:
    """Median cost of keying one prompt, in the pool (encode + keys) and awaited from the loop
    (the thread hop added), for chat prompts of about 2k to 800k characters: the same prompt
    again and again (the prefix store reuses what it tokenized), a prompt seen for the first
    time each round (nothing to reuse; a long one is encoded in pieces, or in one), one that
    starts with 4,000 characters seen before and goes on with new text, and with neither the
    store nor pieces (every prompt encoded whole)."""
    from gateway.kvevents.token_prefix import PrefixStoreOptions
    from gateway.kvevents.tokenize import PromptTokenizer, TokenizerOptions

    rows = ["| prompt chars | tokens | case | in pool, median ms | awaited, median ms |",
            "|---:|---:|---|---:|---:|"]
    corpus = " ".join(r.body["messages"][-1]["content"] for r in requests_for("rag", 40, 1))
    cases = {
        "again": PrefixStoreOptions(),
        "first sight": PrefixStoreOptions(),
        "first sight, one piece": PrefixStoreOptions(chunk_chars=0),
        "known 4,000 characters, then new": PrefixStoreOptions(),
        "whole (no store, one piece)": PrefixStoreOptions(max_segments=0, chunk_chars=0),
    }
    for case, store in cases.items():
        tokenizer = PromptTokenizer(TokenizerOptions(str(tok), prefix_store=store,
                                                     inline_chars=0))
        try:
            for chars in (2_000, 16_000, 64_000, 200_000, 800_000):
                text = (corpus * (chars // len(corpus) + 1))[:chars]
                pool, awaited = [], []
                tokens = 0
                for r in range(rounds):
                    # A new first line makes every checkpoint's text new: nothing to reuse.
                    content = (f"request {chars}/{r}\n{text}" if case.startswith("first")
                               else f"{corpus[:4000]}\nrequest {chars}/{r}\n{text}"
                               if case.startswith("known") else text)
                    body = {"messages": [{"role": "user", "content": content}]}
                    before = tokenizer.stats.seconds
                    started = time.perf_counter()
                    out = await tokenizer.key(body, chat=True, salt="")
                    awaited.append(time.perf_counter() - started)
                    pool.append(tokenizer.stats.seconds - before)
                    tokens = out.tokens if out else 0
                rows.append(f"| {len(text)} | {tokens} | {case} | "
                            f"{1000 * statistics.median(pool):.3f} | "
                            f"{1000 * statistics.median(awaited):.3f} |")
        finally:
            tokenizer.close()
    return "\n".join(rows)


def bookkeeping_cost(workers: int = 4, rounds: int = 30,
                     sizes: Sequence[int] = (1_024, 4_096, 16_384)) -> str:
    """Median cost of the exact index's bookkeeping for one request of ``n`` blocks with
    ``workers`` live workers (no I/O): the send and the answer in the hybrid view (the
    default) and in the events view, and the events view's match (the hybrid view matches on
    the modelled index)."""
    from gateway.kvevents.index import ExactIndex

    rows = ["| prompt blocks | tokens (16 a block) | hybrid: sent + done, ms | events: sent + "
            "done, ms | events: match, ms |", "|---:|---:|---:|---:|---:|"]
    rng = random.Random(1)
    for n in sizes:
        keys = tuple(rng.getrandbits(63) for _ in range(n))
        cells = []
        for hybrid in (True, False):
            index = ExactIndex(hybrid=hybrid)
            for w in range(workers):
                index.worker(f"w{w}")
                index.set_live(f"w{w}", True)
                index.set_capacity(f"w{w}", 1 << 20)
            book, match = [], []
            for r in range(rounds):
                now = r * 0.01
                started = time.perf_counter()
                index.sent("w0", keys, now, reserve=1)
                index.done("w0", keys, now)
                book.append(time.perf_counter() - started)
                started = time.perf_counter()
                index.match(keys, now)
                match.append(time.perf_counter() - started)
            cells.append(f"{1000 * statistics.median(book):.2f}")
            if not hybrid:
                cells.append(f"{1000 * statistics.median(match):.2f}")
        rows.append(f"| {n:,} | {16 * n:,} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def to_markdown(out: dict[str, Any], args: argparse.Namespace) -> str:
    modes = args.modes
    lines = [
        f"{args.workers} workers x {args.cache_blocks} blocks of 16 tokens, {args.requests} "
        f"requests per workload, concurrency {args.concurrency}, seed {args.seed}.",
        "",
        "| workload | " + " | ".join(f"{m} hit | {m} exact" for m in modes) + " |",
        "|---|" + "---:|---:|" * len(modes),
    ]
    for workload, by_mode in out["workloads"].items():
        cells = []
        for m in modes:
            t = by_mode.get(m)
            cells += [f"{t.hit_rate:.3f}", f"{t.exact_share:.4f}"] if t else ["-", "-"]
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    lines += ["", "| disturbance | " + " | ".join(f"{m} exact | {m} hit" for m in modes) + " |",
              "|---|" + "---:|---:|" * len(modes)]
    restart = out["restart"]
    if restart:
        cells = []
        for m in modes:
            _, after = restart[m]
            cells += [f"{after.exact_share:.4f}", f"{after.hit_rate:.3f}"]
        lines.append("| chat, after a worker restart | " + " | ".join(cells) + " |")
    two = out["two_gateways"]
    if two:
        cells = list(itertools.chain.from_iterable(
            (f"{two[m].exact_share:.4f}", f"{two[m].hit_rate:.3f}") for m in modes))
        lines.append("| chat, two gateways, no shared store | " + " | ".join(cells) + " |")
    errors = sum(t.errors for by in out["workloads"].values() for t in by.values())
    lines += ["", f"errors: {errors}"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_exact", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--requests", type=int, default=240, help="requests per workload")
    p.add_argument("--cache-blocks", type=int, default=384, help="KV blocks per worker")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--out", type=Path, help="also write the markdown here")
    p.add_argument("--tokenize-only", action="store_true",
                   help="only measure what keying a prompt with the tokenizer costs")
    p.add_argument("--bookkeeping-only", action="store_true",
                   help="only measure the exact index's bookkeeping per request, by prompt "
                   "length")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.modes) - set(MODES) | set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown mode or workload: {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.bookkeeping_only:
        markdown = bookkeeping_cost(args.workers)
    elif args.tokenize_only:
        with tempfile.TemporaryDirectory(prefix="bench-exact-") as tmp:
            markdown = asyncio.run(tokenize_cost(train(Path(tmp) / "tokenizer.json")))
    else:
        markdown = to_markdown(asyncio.run(bench(args)), args)
    print(markdown)
    if args.out:
        args.out.write_text(markdown + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
