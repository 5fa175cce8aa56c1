"""Benchmark: the router's own cost, ours against the Rust routers, in front of the same workers.

``python -m loadtest.bench_overhead [--workers 4] [--prefixes 20] [--requests 2000]
[--concurrency 32] [--reps 3] [--sequential 300] [--routers ours,sglang-router,smg]
[--procs 1] [--api chat|embeddings|responses] [--stream-tokens N] [--own-core]
[--profile FILE] [--json] [--out FILE]``

One run, one set of workers:

1. ``--workers`` reference workers with zero simulated cost (what is left is HTTP, parsing and
   routing) start once; every router starts in front of all of them at the same time, each on
   its own port: our gateway (``cache_aware``, ``--procs N`` processes), and sglang-router and
   smg (``cache_aware``) where they are installed. The floors (:data:`FLOORS`,
   :mod:`loadtest.floor_proxy`) show what a Python relay costs by part: ``floor`` is
   aiohttp's server and client (run by default), ``floor-h1`` aiohttp's server with the
   gateway's relay client, ``floor-low`` aiohttp's low-level server (no application) with
   that client, ``floor-objects`` a bare protocol server that builds aiohttp's request and
   response objects with that client, ``floor-lean`` a bare protocol server with that client.
2. **Throughput**, ``--reps`` repetitions: each target in turn (the order rotates every
   repetition) gets the same ``--requests`` chat requests at ``--concurrency``: ``--prefixes``
   shared system prompts of about 2,000 characters, each with its own short user question.
   Reported per target: requests/s, p50/p99 latency, errors, and the router's CPU seconds per
   1,000 requests, read from the CPU-time clocks of the router process and its child
   processes (every thread, in nanoseconds: :func:`loadtest.peers.proc_tree_cpu_s`), not
   wall time; beside it the workers' and this client's over the same repetition, since on
   cores they share the requests/s follow the sum of the three (a router can make the
   workers' share dearer or cheaper by how its requests reach them).
   ``direct`` sends to one worker, no router in between.
   ``--api embeddings`` sends the same texts as embeddings requests (what the routers relay
   without prefix routing: the relay's own cost, and how evenly each spreads them);
   ``--api responses`` as Responses API requests (the system prompt as ``instructions``).
   *Prefix affinity*: the share of requests that reached their system prompt's most used
   worker (from the worker's ``x-worker-id``, where the router relays it); with ``--procs N``
   it shows whether the processes agree on where a prefix lives.
3. **Added latency**: ``--sequential`` rounds of one request to each target in turn, in an
   order shuffled each round (seeded): a target's latency depends on which target the workers
   and the machine served just before it, so a fixed or rotating order biases whichever target
   follows another (by 0.1 ms at c=1 here). p50/p99 per target, minus the direct p50, and
   against sglang-router paired by round: the median of the per-round differences.
   ``--own-core`` runs the rounds again with each router on a core of its own and the client
   and the workers on the others (:mod:`loadtest.cpu_pin`): on shared cores the kernel wakes
   a worker on the core of the router that wrote to it, where part of an event loop's work
   after the write can wait with the request; a deployed router has cores of its own.
4. **Streams** (``--stream-tokens N``): streamed answers of N token events, the router's CPU
   per stream and per event (:mod:`loadtest.overhead_stream`).
5. **Long prompts** (``--long CHARS,...``): ``--long-requests`` sequential chat requests per
   size sharing one system prompt, ``--long-reps`` rounds; the router's CPU per request by
   size. The worker takes longer on a long prompt, and a router spends CPU every second on its
   own (health probes, timers), so first every router's CPU per second with no requests is
   measured for ``--idle-s`` seconds, and the table is given again less that rate times each
   round's wall time per request. ``--long-text lines`` (the default) writes the prompt as
   lines of 4-16 words, some indented, as code, documents and agent contexts are;
   ``--long-text words`` as one line of words (what the figures before it used, which spared
   every step that looks at line ends); ``--long-text ragged`` as lines a quarter of which end
   in spaces (a re-rendered context: the normalization rewrites it). ``--long-text
   transcript`` sends an agent transcript of that many characters of tool results with a new
   question in each request, ``transcript-turns`` the transcript two messages longer in each
   request, as an agent's loop sends it.

Medians over the repetitions, and each figure as a ratio to sglang-router's, so the numbers can
be compared on a noisy shared machine. Every other target's CPU per request is also given as a
ratio to ours paired by repetition: many short repetitions (``--reps 8 --requests 400``) with
``--variant before=@DIR`` make an A/B of one change (``--variant other=python=PATH``: of
the interpreter); run it both ways round (each checkout once as ``ours``) and take the
geometric mean: two identical checkouts read 0.96-0.97x, the variant's slot cheaper.
``--profile FILE`` records our gateway with py-spy during the throughput repetitions
(collapsed stacks to FILE) and reports the top functions.

Loopback only, bounded request counts; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from infra.procs import (
    checkout_in,
    free_port_block,
    from_checkout,
    start_server,
    stop_processes,
)
from loadtest.bench_normalize import LONG_TEXTS, agent_messages, long_text
from loadtest.cpu_pin import own_core
from loadtest.harness import (
    HOST,
    MODEL,
    ZERO_COST_WORKER_ARGS,
    emit,
    histogram_totals,
    interpreter,
    percentile,
)
from loadtest.overhead_stream import (
    StreamConfig,
    StreamResult,
    stream_bodies,
    stream_round,
    stream_table,
)
from loadtest.peers import (
    PEERS,
    PeerUnavailableError,
    gateway_log_args,
    peer_launcher,
    proc_tree_cpu_s,
    running_peer,
)
from loadtest.workloads import LiveRequest, as_responses, system_prompt, words

TRANSCRIPT = "transcript"  # --long-text: an agent transcript instead of one long text
TURNS = "transcript-turns"  # --long-text: an agent's turns, each two messages more
COMPLETIONS = "completions"  # --long-api: prompts that each extend the one before
RESPONSES = "responses"  # --long-api: the chats as Responses API requests
FLOOR = "floor"  # loadtest.floor_proxy: a bare aiohttp relay, the floor for a Python router
# The floors (loadtest.floor_proxy), each with its server and client: aiohttp's server and
# client; aiohttp's server and the gateway's relay client; a bare protocol and that client.
FLOORS: dict[str, tuple[str, ...]] = {
    FLOOR: (),
    "floor-h1": ("--client", "http1"),
    "floor-low": ("--client", "http1", "--server", "lowlevel"),
    "floor-lean": ("--client", "http1", "--server", "protocol"),
    "floor-objects": ("--client", "http1", "--server", "objects"),
}
ROUTERS = ("ours", *FLOORS, *PEERS)
DEFAULT_ROUTERS = ("ours", FLOOR, *PEERS)
DIRECT = "direct"
# The path of each ``--api``.
API_PATHS = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings",
             "responses": "/v1/responses"}


@dataclass(frozen=True, slots=True)
class OverheadConfig:
    workers: int = 4
    prefixes: int = 20
    requests: int = 2000
    concurrency: int = 32
    reps: int = 3
    sequential: int = 300
    routers: tuple[str, ...] = DEFAULT_ROUTERS
    procs: int = 1
    seed: int = 13
    gateway_args: tuple[str, ...] = ()
    # Whether every router logs each request as it does by default (ours: one JSON access
    # line; the peers at --log-level info: two lines); otherwise none does (ours
    # --access-log off, the peers at warn). Per-request logging was 7% of our CPU per request.
    request_logs: bool = False
    # Extra copies of our gateway, each with its own extra arguments: ("label", (args...)),
    # shown as "ours[label]", to measure one option's effect side by side.
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Long prompts: system prompt sizes in characters (~4 per token), sent sequentially,
    # ``long_requests`` each; the router's CPU per request is reported per size.
    long_chars: tuple[int, ...] = ()
    long_requests: int = 20
    long_reps: int = 1  # rounds over every size, targets in rotating order; medians reported
    long_text: str = "lines"  # one of LONG_TEXTS: how the long prompts' text is laid out
    long_unique: bool = False  # each long request with a system prompt of its own
    # Agents whose loops (``--long-api completions``, ``--long-text transcript-turns``) share
    # their long opening and interleave: ``long_requests`` turns each, one agent after the other.
    long_sessions: int = 1
    # "chat", or "completions": an agent's loop over /v1/completions, each prompt the one
    # before and a line more
    long_api: str = "chat"
    # What the throughput and latency phases send: "chat" (chat completions), "embeddings"
    # (the same texts as OpenAI embeddings requests, which the routers relay without prefix
    # routing) or "responses" (as Responses API requests: the system prompt as instructions).
    api: str = "chat"
    # Seconds with no requests before the long prompts, to measure what each router spends
    # per second on its own (health probes, timers): a long request that takes the worker
    # 0.2 s is charged 0.2 s of it.
    idle_s: float = 10.0
    stream: StreamConfig = field(default_factory=StreamConfig)  # streamed answers
    # The workers' time per output token (0: events back to back). Paces streamed answers as
    # an engine does; every phase's answers take that much longer per token.
    decode_ms: float = 0.0
    # The sequential rounds again with each router on a core of its own and the client and
    # the workers on the others (loadtest.cpu_pin), as a router runs where it is deployed.
    own_core: bool = False


@dataclass(frozen=True, slots=True)
class Rep:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s_per_1k: float  # the router's CPU seconds per 1,000 requests (0 for direct)
    # The workers' and this client's CPU seconds per 1,000 requests in the same repetition:
    # on shared cores the requests/s follow the sum of the three, not the router's alone.
    workers_cpu_s_per_1k: float = 0.0
    client_cpu_s_per_1k: float = 0.0


@dataclass(slots=True)
class TargetResult:
    name: str
    reps: list[Rep] = field(default_factory=list)
    seq_p50_ms: float = 0.0
    seq_p99_ms: float = 0.0
    seq_ms: list[float] = field(default_factory=list)  # each sequential round's latency
    seq_errors: int = 0
    # The sequential rounds with each router on a core of its own (--own-core).
    own_seq_p50_ms: float = 0.0
    own_seq_ms: list[float] = field(default_factory=list)
    worker_share: dict[str, int] = field(default_factory=dict)  # x-worker-id, if relayed
    # Share of requests that reached their prefix's most used worker (1.0: every prefix always
    # went to one worker); 0 when the router does not relay the worker's id.
    affinity: float = 0.0
    # Our gateway: share of requests its index routed as a prefix hit (x-prefix-match-blocks
    # > 0); -1 for routers that do not say. With --procs N: do the processes share the index?
    index_hits: float = -1.0
    long_cpu_ms: dict[int, float] = field(default_factory=dict)  # prompt chars -> CPU ms/req
    long_cpu_runs: dict[int, list[float]] = field(default_factory=dict)  # each round's
    # Our gateway: mean routing decision time per long request, in microseconds (its
    # gateway_route_decision_seconds histogram, read before and after each size's round).
    long_decision_us: dict[int, float] = field(default_factory=dict)
    long_decision_runs: dict[int, list[float]] = field(default_factory=dict)
    long_errors: int = 0  # long requests not answered 200
    # CPU ms per second with no requests (-1: not measured), and each long round's CPU per
    # request less that rate times the round's wall time per request.
    idle_ms_per_s: float = -1.0
    long_net_runs: dict[int, list[float]] = field(default_factory=dict)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.reps) if self.reps else 0.0


@dataclass(slots=True)
class OverheadResult:
    command: str
    config: OverheadConfig
    targets: list[TargetResult]
    skipped: dict[str, str]  # router -> why it did not run
    profile_top: list[tuple[str, float, float]] = field(default_factory=list)
    streams: dict[str, StreamResult] = field(default_factory=dict)  # router -> streaming phase


# -- processes -----------------------------------------------------------------------------


def gateway_command(port: int, worker_urls: Sequence[str], config: OverheadConfig,
                    extra: Sequence[str] = ()) -> list[str]:
    """Our gateway (cache_aware) in front of ``worker_urls``; an ``@DIR`` in ``extra`` runs the
    gateway from the checkout in DIR instead of this one, a ``python=PATH`` with the
    interpreter PATH (a virtual environment's, with the gateway's dependencies) instead of
    this one."""
    python = next((a.removeprefix("python=") for a in extra if a.startswith("python=")),
                  sys.executable)
    cmd = [python, "-m", "gateway", "--host", HOST, "--port", str(port),
           "--policy", "cache_aware", *gateway_log_args(config.request_logs),
           *config.gateway_args,
           *(a for a in extra if not a.startswith(("@", "python=")))]
    if config.procs > 1:
        cmd += ["--procs", str(config.procs)]
    for url in worker_urls:
        cmd += ["--worker", url]
    return from_checkout(cmd, checkout_in(extra))


def floor_command(port: int, worker_urls: Sequence[str], name: str = FLOOR) -> list[str]:
    """The floor ``name`` (:data:`FLOORS`, :mod:`loadtest.floor_proxy`) in front of
    ``worker_urls``."""
    return [sys.executable, "-m", "loadtest.floor_proxy", "--host", HOST, "--port", str(port),
            *(a for w in worker_urls for a in ("--worker", w)), *FLOORS[name]]


def available(name: str) -> str:
    """Why router ``name`` cannot run here ("" if it can)."""
    if name == "ours" or name in FLOORS:
        return ""
    return "" if peer_launcher(name) is not None else "not installed (pip install '.[peers]')"


async def wait_routing(session: aiohttp.ClientSession, url: str, body: bytes,
                       timeout_s: float = 30.0) -> None:
    """Wait until ``url`` answers a completion with 200 (peers register workers asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(url, data=body, headers=_JSON) as response:
                await response.read()
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not route a request within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str  # the chat completions URL
    pid: int  # the router's process (0: direct)
    workers: tuple[int, ...] = ()  # the workers' processes (every target's, the same)


@contextlib.asynccontextmanager
async def running_targets(
    config: OverheadConfig, session: aiohttp.ClientSession, probe: bytes,
    skipped: dict[str, str],
) -> AsyncIterator[list[Target]]:
    routers = [r for r in config.routers if not skipped.setdefault(r, available(r))]
    for r in routers:
        skipped.pop(r)
    ours: list[tuple[str, tuple[str, ...]]] = [("ours", ())] if "ours" in routers else []
    ours += [(f"ours[{label}]", tuple(args)) for label, args in config.variants]
    ours += [(name, ()) for name in FLOORS if name in routers]
    base = free_port_block(config.workers + len(ours))
    worker_urls = [f"http://{HOST}:{base + i}" for i in range(config.workers)]
    procs: list[asyncio.subprocess.Process] = []
    logs = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="bench-overhead-"))
    try:
        async with contextlib.AsyncExitStack() as stack:
            for i, url in enumerate(worker_urls):
                cmd = [sys.executable, "-m", "worker", "--host", HOST, "--port", str(base + i),
                       "--model", MODEL, *worker_size_args(config), *ZERO_COST_WORKER_ARGS,
                       "--decode-ms-per-token", str(config.decode_ms)]
                await start_server(cmd, url, logs / f"worker{i}.log", procs)
            workers = tuple(p.pid for p in procs)
            targets = [Target(DIRECT, worker_urls[0] + API_PATHS[config.api], 0, workers)]
            for j, (name, extra) in enumerate(ours):
                port = base + config.workers + j
                url = f"http://{HOST}:{port}"
                cmd = (floor_command(port, worker_urls, name) if name in FLOORS
                       else gateway_command(port, worker_urls, config, extra))
                await start_server(cmd, url, logs / f"{name}.log", procs)
                targets.append(Target(name, url + API_PATHS[config.api], procs[-1].pid,
                                      workers))
            for name in routers:
                if name in PEERS:
                    try:
                        peer = await stack.enter_async_context(
                            running_peer(name, worker_urls, logs, host=HOST,
                                         request_logs=config.request_logs))
                    except PeerUnavailableError as exc:
                        print(f"[bench] {exc}", file=sys.stderr, flush=True)
                        skipped[name] = str(exc).splitlines()[0]
                        continue
                    targets.append(Target(name, peer.url + API_PATHS[config.api], peer.pid,
                                          workers))
            for t in targets:
                await wait_routing(session, t.url, probe)
            yield targets
    finally:
        await stop_processes(procs, grace_s=5.0)
        await asyncio.to_thread(shutil.rmtree, logs, True)


# -- load ----------------------------------------------------------------------------------

_JSON = {"Content-Type": "application/json"}


def worker_size_args(config: OverheadConfig) -> list[str]:
    """The workers' context length and cache, large enough that the longest long prompt is
    served and cached (a prompt has at most one token per character): a worker that refused
    it would leave every request of that size a cold placement for the gateway."""
    longest = max(config.long_chars, default=0)
    return ["--max-model-len", str(max(32_768, longest + 1024)),
            "--cache-blocks", str(max(4096, 2 * (longest // 16 + 1)))]


def long_bodies(config: OverheadConfig, chars: int, rep: int = 0) -> list[bytes]:
    """``long_requests`` chat bodies sharing one system prompt of ``chars`` characters, or
    (``long_unique``) each with its own, which begins with the round ``rep`` and the
    request's number, so that no round sends a prompt an earlier one did; with ``long_api``
    ``completions``, completions bodies whose prompts each add a line to the one before (the
    first the long text, after the round's number with ``long_unique``); with
    ``long_text`` ``transcript``, sharing an agent transcript (tool calls and results) of
    that many characters of results instead."""
    rng = random.Random(config.seed + chars)
    if config.long_api == COMPLETIONS:
        if config.long_text not in LONG_TEXTS:
            raise ValueError(f"--long-api completions takes a text layout, one of {LONG_TEXTS}")
        prompt = (f"Document {rep}.\n" if config.long_unique else "") + long_text(
            rng, chars, config.long_text)
        sessions = config.long_sessions
        agents = [prompt + (f"\nAgent {s}." if sessions > 1 else "") for s in range(sessions)]
        bodies = []
        for i in range(config.long_requests):
            for s in range(sessions):
                bodies.append(json.dumps({"model": MODEL, "max_tokens": 1, "temperature": 0,
                                          "prompt": agents[s]}).encode())
                agents[s] += f"\nTurn {i}: {words(rng, 12)}"
        return bodies
    chats = _long_chats(config, chars, rep, rng)
    if config.long_api == RESPONSES:
        return [json.dumps(as_responses(LiveRequest(API_PATHS["chat"], chat)).body).encode()
                for chat in chats]
    return [json.dumps(chat).encode() for chat in chats]


def _long_chats(config: OverheadConfig, chars: int, rep: int,
                rng: random.Random) -> list[dict[str, Any]]:
    """The chat bodies of :func:`long_bodies` (all but ``--long-api completions``)."""
    if config.long_text == TURNS:
        # The same transcript, continued: request i carries its first turns and 2 i more
        # messages (a tool call and its result), as an agent's loop sends them.
        first = len(agent_messages(random.Random(config.seed + chars), chars=chars))
        turns = agent_messages(rng, messages=first + 2 * config.long_requests, chars=chars)
        # Further agents go on from the same first turns with tool calls of their own.
        loops = [turns] + [
            turns[:first] + agent_messages(random.Random(config.seed + chars + s),
                                           messages=first + 2 * config.long_requests,
                                           chars=chars)[first:]
            for s in range(1, config.long_sessions)]
        agent = {"role": "system", "content": "You are a coding agent."}
        return [{"model": MODEL, "max_tokens": 1, "temperature": 0,
                 "messages": [agent, *loop[:first + 2 * i]]}
                for i in range(config.long_requests) for loop in loops]
    transcript = config.long_text == TRANSCRIPT
    history = agent_messages(rng, chars=chars) if transcript else []
    shared = "You are a coding agent." if transcript else long_text(rng, chars, config.long_text)

    def system(i: int) -> str:
        if not config.long_unique:
            return shared
        return f"Agent {rep}.{i}." if transcript else f"Document {rep}.{i}.\n{shared}"

    return [
        {"model": MODEL, "max_tokens": 1, "temperature": 0,
         "messages": [{"role": "system", "content": system(i)}, *history,
                      {"role": "user", "content": f"Question {i}: {words(rng, 12)}?"}]}
        for i in range(config.long_requests)
    ]


def bodies_for(config: OverheadConfig) -> tuple[list[bytes], list[int]]:
    """``requests`` chat bodies: one of ``prefixes`` system prompts + a short unique question
    (with ``api`` "embeddings", both as the input of an embeddings request); and the prefix
    each body uses."""
    rng = random.Random(config.seed)
    prompts = [system_prompt(config.seed, t, (1800, 2200)) for t in range(config.prefixes)]
    out, prefixes = [], []
    for i in range(config.requests):
        prefix = rng.randrange(config.prefixes)
        question = f"Question {i}: {words(rng, 12)}?"
        body: dict[str, Any] = {
            "model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [
                {"role": "system", "content": prompts[prefix]},
                {"role": "user", "content": question},
            ],
        }
        if config.api == "embeddings":
            body = {"model": MODEL, "input": prompts[prefix] + "\n" + question}
        elif config.api == "responses":
            body = {"model": MODEL, "instructions": prompts[prefix], "input": question,
                    "max_output_tokens": 1}
        out.append(json.dumps(body).encode())
        prefixes.append(prefix)
    return out, prefixes


def prefix_affinity(routed: Counter[tuple[int, str]]) -> float:
    """Share of requests that went to their prefix's most used worker."""
    best: dict[int, int] = {}
    routed = Counter({k: n for k, n in routed.items() if k[0] >= 0})
    for (prefix, _), n in routed.items():
        best[prefix] = max(best.get(prefix, 0), n)
    total = sum(routed.values())
    return sum(best.values()) / total if total else 0.0


async def send(session: aiohttp.ClientSession, url: str,
               body: bytes) -> tuple[int, float, str, int]:
    """Status, seconds, the worker's id (if relayed) and our gateway's
    ``x-prefix-match-blocks`` (-1 where absent)."""
    started = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=_JSON) as response:
            await response.read()
            headers = response.headers
            worker = headers.get("x-worker-id") or headers.get("x-route-worker") or ""
            blocks = headers.get("x-prefix-match-blocks", "")
            return (response.status, time.perf_counter() - started, worker,
                    int(blocks) if blocks.isdigit() else -1)
    except (aiohttp.ClientError, TimeoutError):
        return 0, time.perf_counter() - started, "", -1


async def throughput(session: aiohttp.ClientSession, target: Target, bodies: Sequence[bytes],
                     concurrency: int, routed: Counter[tuple[int, str]],
                     prefixes: Sequence[int] = ()) -> Rep:
    order = iter(range(len(bodies)))
    seconds: list[float] = []
    errors = 0

    async def sender() -> None:
        nonlocal errors
        for i in order:
            status, s, worker, blocks = await send(session, target.url, bodies[i])
            seconds.append(s)
            errors += status != 200
            if worker:
                routed[prefixes[i] if prefixes else 0, worker] += 1
            if blocks >= 0:
                routed[-1, "index hit" if blocks > 0 else "index miss"] += 1

    def cpu() -> tuple[float, float, float]:
        return (proc_tree_cpu_s(target.pid) if target.pid else 0.0,
                sum(proc_tree_cpu_s(w) for w in target.workers), time.process_time())

    before = await asyncio.to_thread(cpu)
    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    after = await asyncio.to_thread(cpu)
    router, workers, client = ((b - a) * 1000 / len(bodies) for a, b in zip(before, after,
                                                                          strict=True))
    ms = [s * 1e3 for s in seconds]
    return Rep(
        rps=len(bodies) / wall, p50_ms=statistics.median(ms), p99_ms=percentile(ms, 99),
        errors=errors, cpu_s_per_1k=router, workers_cpu_s_per_1k=workers,
        client_cpu_s_per_1k=client,
    )


def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= len(items)
    return [*items[k:], *items[:k]]


async def sequential(session: aiohttp.ClientSession, targets: Sequence[Target],
                     bodies: Sequence[bytes], rounds: int,
                     results: dict[str, TargetResult]) -> dict[str, list[float]]:
    """``rounds`` rounds of one request to each target in a shuffled order (after 20 rounds
    of warm-up): each target's latencies in ms, round by round."""
    seconds: dict[str, list[float]] = {t.name: [] for t in targets}
    order = list(targets)
    shuffle = random.Random(0).shuffle
    for i in range(rounds + 20):  # the first 20 rounds warm up
        shuffle(order)
        for target in order:
            status, s, _, _ = await send(session, target.url, bodies[i % len(bodies)])
            if i >= 20:
                seconds[target.name].append(s)
                results[target.name].seq_errors += status != 200
    return {name: [s * 1e3 for s in values] for name, values in seconds.items()}


def paired_ms(target: TargetResult, ref: TargetResult, own_core: bool = False) -> float | None:
    """The median over sequential rounds of ``target``'s latency less ``ref``'s in the same
    round (None without rounds); ``own_core``: of the rounds with each router on its own
    core."""
    mine, theirs = ((target.own_seq_ms, ref.own_seq_ms) if own_core
                    else (target.seq_ms, ref.seq_ms))
    if not mine or len(mine) != len(theirs):
        return None
    return statistics.median(t - r for t, r in zip(mine, theirs, strict=True))


# -- profile -------------------------------------------------------------------------------


def top_functions(collapsed: str, count: int = 15) -> list[tuple[str, float, float]]:
    """(function, self share, inclusive share) of the ``count`` functions with the most self
    samples in py-spy's collapsed stacks (``frame;frame;frame N`` per line)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        samples = int(n)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    if not total:
        return []
    return [(f, n / total, inclusive[f] / total) for f, n in own.most_common(count)]


@contextlib.asynccontextmanager
async def profiling(pid: int, out: Path | None) -> AsyncIterator[None]:
    if out is None or not pid:
        yield
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    proc = await asyncio.create_subprocess_exec(
        py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
        "--subprocesses", "--nonblocking", "--nolineno", "-o", str(out),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
        await asyncio.wait_for(proc.wait(), 30)


# -- the run -------------------------------------------------------------------------------


async def run_bench(config: OverheadConfig, command: str, profile: Path | None) -> OverheadResult:
    bodies, prefixes = bodies_for(config)
    skipped: dict[str, str] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as session, running_targets(config, session, bodies[0], skipped) as targets:
        results = {t.name: TargetResult(t.name) for t in targets}
        routed = {t.name: Counter[tuple[int, str]]() for t in targets}
        ours = next((t.pid for t in targets if t.name == "ours"), 0)
        for t in targets:  # warm every keep-alive pool and every router's tree
            await throughput(session, t, bodies[:200], config.concurrency, Counter())
        print("[bench] sequential ...", file=sys.stderr, flush=True)
        for name, ms in (await sequential(
                session, targets, bodies, config.sequential, results)).items():
            results[name].seq_ms, results[name].seq_p50_ms = ms, statistics.median(ms)
            results[name].seq_p99_ms = percentile(ms, 99)
        if config.own_core:
            with own_core(t.pid for t in targets if t.pid) as pinned:
                if pinned:
                    print("[bench] sequential, each router on its own core ...",
                          file=sys.stderr, flush=True)
                    for name, ms in (await sequential(
                            session, targets, bodies, config.sequential, results)).items():
                        results[name].own_seq_ms = ms
                        results[name].own_seq_p50_ms = statistics.median(ms)
                else:
                    skipped["own core"] = "fewer than two CPUs"
        async with profiling(ours, profile):
            for rep in range(config.reps):
                for t in _rotated(targets, rep):
                    print(f"[bench] rep {rep + 1}: {t.name} ...", file=sys.stderr, flush=True)
                    results[t.name].reps.append(await throughput(
                        session, t, bodies, config.concurrency, routed[t.name], prefixes))
        for name, pairs in routed.items():
            share: Counter[str] = Counter()
            for (prefix, worker), n in pairs.items():
                if prefix >= 0:
                    share[worker] += n
            seen = pairs[-1, "index hit"] + pairs[-1, "index miss"]
            results[name].index_hits = pairs[-1, "index hit"] / seen if seen else -1.0
            results[name].worker_share = dict(sorted(share.items()))
            results[name].affinity = prefix_affinity(pairs)
        await long_prompts(session, config, [t for t in targets if t.pid], results)
        streams = await streaming(session, config, [t for t in targets if t.pid])
    return OverheadResult(command, config, list(results.values()), skipped, streams=streams)


async def streaming(session: aiohttp.ClientSession, config: OverheadConfig,
                    targets: Sequence[Target]) -> dict[str, StreamResult]:
    """The streaming phase (``--stream-tokens``): every router, ``reps`` rounds, rotated."""
    stream = config.stream
    if not stream.tokens:
        return {}
    bodies = stream_bodies(MODEL, stream, config.seed)
    results = {t.name: StreamResult() for t in targets}
    for rep in range(stream.reps):
        for t in _rotated(targets, rep):
            print(f"[bench] streams, round {rep + 1}: {t.name} ...", file=sys.stderr, flush=True)
            await stream_round(session, t.url, t.pid, bodies, stream.concurrency, results[t.name])
    return results


async def decision_totals(session: aiohttp.ClientSession, target: Target) -> tuple[float, int]:
    """Our gateway's routing decisions so far: (seconds summed, count), from its /metrics."""
    base = target.url.rsplit("/v1/", 1)[0]  # target.url is the chat completions URL
    async with session.get(base + "/metrics") as resp:
        return histogram_totals(await resp.text(), "gateway_route_decision_seconds")


async def long_prompts(session: aiohttp.ClientSession, config: OverheadConfig,
                       targets: Sequence[Target], results: dict[str, TargetResult]) -> None:
    """Each long size, ``long_reps`` rounds, targets in rotating order: every router's CPU ms
    per request and our gateways' decision time; medians over the rounds."""
    sizes = {chars: long_bodies(config, chars) for chars in config.long_chars}
    if sizes and config.idle_s > 0:
        await idle_cpu(targets, results, config.idle_s)
    for rep in range(config.long_reps):
        if config.long_unique and rep > 0:  # prompts no round has sent
            sizes = {chars: long_bodies(config, chars, rep) for chars in config.long_chars}
        for chars, bodies in sizes.items():
            for t in _rotated(targets, rep):
                print(f"[bench] long prompts, {chars} chars, round {rep + 1}: {t.name} ...",
                      file=sys.stderr, flush=True)
                ours = t.name.startswith("ours")
                before = await decision_totals(session, t) if ours else (0.0, 0)
                target = t
                if config.long_api in (COMPLETIONS, RESPONSES):
                    path = "/v1/completions" if config.long_api == COMPLETIONS else "/v1/responses"
                    target = replace(t, url=t.url.replace("/v1/chat/completions", path))
                one = await throughput(session, target, bodies, 1, Counter())
                result = results[t.name]
                result.long_cpu_runs.setdefault(chars, []).append(one.cpu_s_per_1k)
                result.long_errors += one.errors
                if result.idle_ms_per_s >= 0 and one.rps > 0:
                    result.long_net_runs.setdefault(chars, []).append(
                        one.cpu_s_per_1k - result.idle_ms_per_s / one.rps)
                if ours:
                    after = await decision_totals(session, t)
                    if after[1] > before[1]:
                        result.long_decision_runs.setdefault(chars, []).append(
                            (after[0] - before[0]) / (after[1] - before[1]) * 1e6)
    for result in results.values():
        result.long_cpu_ms = {c: statistics.median(v) for c, v in result.long_cpu_runs.items()}
        result.long_decision_us = {c: statistics.median(v)
                                   for c, v in result.long_decision_runs.items()}


async def idle_cpu(targets: Sequence[Target], results: dict[str, TargetResult],
                   seconds: float) -> None:
    """Each router's CPU ms per second over ``seconds`` with no requests, all at once."""
    print(f"[bench] idle CPU, {seconds:g} s ...", file=sys.stderr, flush=True)
    before = [await asyncio.to_thread(proc_tree_cpu_s, t.pid) for t in targets]
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    after = [await asyncio.to_thread(proc_tree_cpu_s, t.pid) for t in targets]
    wall = time.perf_counter() - started
    for t, cpu0, cpu1 in zip(targets, before, after, strict=True):
        results[t.name].idle_ms_per_s = (cpu1 - cpu0) * 1000 / wall


# -- output --------------------------------------------------------------------------------


def _added(t: TargetResult, direct: TargetResult | None, own_core: bool = False) -> str:
    """``t``'s sequential p50 over the direct one's (direct's own p50 in parentheses)."""
    p50 = t.own_seq_p50_ms if own_core else t.seq_p50_ms
    if t.name == DIRECT:
        return f"({p50:.2f})"
    base = 0.0 if direct is None else direct.own_seq_p50_ms if own_core else direct.seq_p50_ms
    return f"{p50 - base:+.2f}"


def _signed(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:+.3f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _long_rows(result: OverheadResult, sizes: Sequence[int],
               cells_of: Callable[[TargetResult], dict[int, tuple[float, list[float]]]],
               ) -> list[str]:
    rows = []
    for t in result.targets:
        cells = cells_of(t)
        if cells:
            shown = [f"{cells[s][0]:.2f} (" + ", ".join(f"{v:.2f}" for v in cells[s][1]) + ")"
                     if s in cells else "-" for s in sizes]
            first, last = cells.get(sizes[0]), cells.get(sizes[-1])
            ratio = _ratio(last[0], first[0]) if first and last else "-"
            rows.append(f"| {t.name} | " + " | ".join(shown) + f" | {ratio} |")
    return rows


def long_table(result: OverheadResult) -> list[str]:
    """Router CPU ms per long request by prompt size (median of the rounds, each round in
    brackets), the largest over the smallest, and our gateways' decision time."""
    c = result.config
    sizes = sorted({s for t in result.targets for s in t.long_cpu_runs})
    if not sizes:
        return []
    what = (f"completions requests, each prompt the one before and a line more, the first "
            f"{'new in each round' if c.long_unique else 'the same in each round'}, of"
            if c.long_api == COMPLETIONS else
            f"{'Responses API' if c.long_api == RESPONSES else 'chat'} requests "
            f"{'each with its own' if c.long_unique else 'sharing one'} system prompt of")
    agents = (f" from {c.long_sessions} agents sharing their opening, one turn each in turn"
              if c.long_sessions > 1 else "")
    lines = ["", f"Long prompts: {c.long_requests} sequential {what} "
             f"the given size ({c.long_text}){agents}, {c.long_reps} round(s); "
             "router CPU ms per "
             "request, median (each round):", "",
             "| target | " + " | ".join(f"{s:,} chars" for s in sizes)
             + f" | {sizes[-1]:,} / {sizes[0]:,} |", "|---|" + "---:|" * (len(sizes) + 1)]
    lines += _long_rows(result, sizes, lambda t: {
        s: (statistics.median(v), v) for s, v in t.long_cpu_runs.items()})
    if any(t.long_net_runs for t in result.targets):
        lines += ["", "Less what each router spends with no requests over the same wall time "
                  "(its idle CPU ms per second: " + ", ".join(
                      f"{t.name} {t.idle_ms_per_s:.2f}" for t in result.targets
                      if t.idle_ms_per_s >= 0) + "):", "",
                  lines[3], lines[4]]
        lines += _long_rows(result, sizes, lambda t: {
            s: (statistics.median(v), v) for s, v in t.long_net_runs.items()})
    for t in result.targets:
        if t.long_errors:
            lines.append(f"- {t.name}: **{t.long_errors} long requests failed** (not 200)")
    for t in result.targets:
        if t.long_decision_us:
            lines.append(f"- {t.name}: routing decision " + ", ".join(
                f"{t.long_decision_us[s]:.0f} us at {s:,} chars"
                for s in sizes if s in t.long_decision_us))
    return lines


def to_markdown(result: OverheadResult) -> str:
    c = result.config
    ref = next((t for t in result.targets if t.name == "sglang-router"), None)
    lines = [
        "```", result.command, "```", "",
        f"{c.workers} " + (f"workers at {c.decode_ms:g} ms per output token (no other cost)"
                           if c.decode_ms else "zero-cost workers")
        + f", {c.prefixes} shared system prompts (~2,000 chars) + a "
        + {"chat": "unique question, `max_tokens` 1",
           "embeddings": "unique question, each as the input of an embeddings request "
                         "(`/v1/embeddings`)",
           "responses": "unique question as a Responses API request (`/v1/responses`: the "
                        "system prompt as `instructions`), `max_output_tokens` 1"}[c.api]
        + f". Throughput: {c.requests} requests at concurrency "
        f"{c.concurrency}, {c.reps} repetitions (medians shown). Added latency: {c.sequential} "
        f"sequential rounds, one request to each target per round in shuffled order. Router "
        f"CPU: the CPU clocks of its process and children (every thread, ns). Our gateway: "
        f"{c.procs} process(es) on {interpreter()}. "
        + ("Every router logs each request (ours one JSON access line, the peers at "
           "`--log-level info`)." if c.request_logs else "No router logs each request (ours "
           "`--access-log off`, the peers at `--log-level warn`)."),
        "",
    ]
    direct = next((t for t in result.targets if t.name == DIRECT), None)
    own_rounds = direct is not None and bool(direct.own_seq_ms)  # --own-core ran
    lines += [
        "| target | req/s c=32 | p50 ms | p99 ms | CPU s / 1k req | added p50 c=1 ms | "
        "p99 c=1 ms | " + ("added p50 c=1 ms, each router on its own core | "
                           if own_rounds else "")
        + "prefix affinity | index hits | errors |",
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if own_rounds else "") + "---:|---:|---:|",
    ]
    for t in result.targets:
        cpu = f"{t.median('cpu_s_per_1k'):.3f}" if t.name != DIRECT else "-"
        errors = sum(r.errors for r in t.reps) + t.seq_errors
        lines.append(
            f"| {t.name} | {t.median('rps'):,.0f} | {t.median('p50_ms'):.2f} | "
            f"{t.median('p99_ms'):.2f} | {cpu} | {_added(t, direct)} | {t.seq_p99_ms:.2f} | "
            + (f"{_added(t, direct, own_core=True)} | " if own_rounds else "")
            + f"{t.affinity:.3f} | "
            f"{f'{t.index_hits:.3f}' if t.index_hits >= 0 else '-'} | {errors} |")
    if ref is not None:
        pinned = bool(ref.own_seq_ms)
        lines += ["", "Ratios to sglang-router (same run):", "",
                  "| target | req/s | p99 c=32 | CPU / req | added p50 c=1 (ms difference) | "
                  "c=1 paired by round (ms) |" + (" c=1 paired, each router on its own core "
                                                  "(ms) |" if pinned else ""),
                  "|---|---:|---:|---:|---:|---:|" + ("---:|" if pinned else "")]
        for t in result.targets:
            if t.name in (DIRECT, ref.name):
                continue
            paired_c1 = paired_ms(t, ref)
            lines.append(
                f"| {t.name} | {_ratio(t.median('rps'), ref.median('rps'))} | "
                f"{_ratio(t.median('p99_ms'), ref.median('p99_ms'))} | "
                f"{_ratio(t.median('cpu_s_per_1k'), ref.median('cpu_s_per_1k'))} | "
                f"{t.seq_p50_ms - ref.seq_p50_ms:+.2f} | "
                f"{'-' if paired_c1 is None else f'{paired_c1:+.3f}'} |"
                + (f" {_signed(paired_ms(t, ref, own_core=True))} |" if pinned else ""))
    ours = next((t for t in result.targets if t.name == "ours"), None)
    paired = [t for t in result.targets if ours is not None and t is not ours and t.reps
              and t.name != DIRECT and len(t.reps) == len(ours.reps)]
    if ours is not None and paired:
        lines += ["", "CPU per request against ours, paired by repetition (each repetition "
                  "runs every target once, in rotating order; median of the per-repetition "
                  "ratios, which cancels the load that drifts between repetitions):", ""]
        for t in paired:
            ratios = [r.cpu_s_per_1k / o.cpu_s_per_1k
                      for r, o in zip(t.reps, ours.reps, strict=True) if o.cpu_s_per_1k > 0]
            if ratios:
                lines.append(f"- {t.name}: {statistics.median(ratios):.3f}x ours")
    lines += ["", "CPU seconds per 1,000 requests at c=32 by process, medians of the "
              "repetitions (router, workers, this client; on cores they share, requests/s "
              "follow the sum):", "", "| target | router | workers | client | sum |",
              "|---|---:|---:|---:|---:|"]
    for t in result.targets:
        parts = [t.median(a) for a in ("cpu_s_per_1k", "workers_cpu_s_per_1k",
                                       "client_cpu_s_per_1k")]
        lines.append(f"| {t.name} | " + " | ".join(f"{v:.3f}" for v in parts)
                     + f" | {sum(parts):.3f} |")
    lines += ["", "Per repetition (req/s, p99 ms, CPU s / 1k):", ""]
    for t in result.targets:
        reps = "; ".join(f"{r.rps:,.0f}, {r.p99_ms:.1f}, {r.cpu_s_per_1k:.3f}" for r in t.reps)
        lines.append(f"- {t.name}: {reps}")
    lines += long_table(result)
    lines += stream_table(result.config.stream, result.streams,
                          {t.name: t.median("cpu_s_per_1k") for t in result.targets},
                          "sglang-router")
    for name, why in result.skipped.items():
        lines.append(f"- {name}: not run ({why})")
    if result.profile_top:
        lines += ["", "py-spy, our gateway during the throughput repetitions (top functions by "
                  "own samples):", "", "| function | own | inclusive |", "|---|---:|---:|"]
        for fn, own, inclusive in result.profile_top:
            lines.append(f"| `{fn}` | {own:.1%} | {inclusive:.1%} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_overhead",
        description="Router CPU, throughput and added latency: ours vs sglang-router and smg.",
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prefixes", type=int, default=20)
    p.add_argument("--requests", type=int, default=2000, help="requests per repetition")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sequential", type=int, default=300, help="sequential rounds (c=1)")
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS),
                   help=f"comma-separated, from {', '.join(ROUTERS)}")
    p.add_argument("--procs", type=int, default=1, help="our gateway's processes")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra argument for our gateway (repeatable)")
    p.add_argument("--request-logs", action="store_true",
                   help="every router logs each request as it does by default (ours one "
                   "JSON access line, the peers at --log-level info); without it none does "
                   "(ours --access-log off, the peers at --log-level warn)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also run our gateway as 'ours[LABEL]' with these extra arguments "
                   "(repeatable), e.g. asyncio='--event-loop asyncio'; an argument @DIR runs "
                   "the gateway from the checkout in DIR (e.g. the last release), an argument "
                   "python=PATH with that interpreter (e.g. another build of CPython)")
    p.add_argument("--long", default="", metavar="CHARS,...",
                   help="also send long prompts of these sizes in characters, sequentially")
    p.add_argument("--long-requests", type=int, default=20, help="requests per long size")
    p.add_argument("--long-unique", action="store_true",
                   help="give each long request a system prompt of its own (nothing in it was "
                        "seen before), instead of one they share")
    p.add_argument("--long-sessions", type=int, default=1, metavar="N",
                   help="with --long-api completions or --long-text transcript-turns: N "
                        "agents that share their long opening, their turns interleaved "
                        "(--long-requests turns each)")
    p.add_argument("--long-text", choices=(*LONG_TEXTS, TRANSCRIPT, TURNS), default="lines",
                   help="the long prompts' text: lines of words (as code and documents), one "
                        "line of words, lines a quarter of which end in spaces, lines with "
                        "typographic quotes and dashes or with emoji, or lines of CJK; or an "
                        "agent transcript: tool calls and their results, that many "
                        "characters of them, the same in every request or (transcript-turns) "
                        "two messages longer in each, as an agent's loop sends them")
    p.add_argument("--api", choices=sorted(API_PATHS), default="chat",
                   help="what the throughput and latency phases send: chat completions, the "
                        "same texts as embeddings requests (relayed without prefix routing), "
                        "or as Responses API requests")
    p.add_argument("--long-api", choices=("chat", COMPLETIONS, RESPONSES), default="chat",
                   help="chat requests, or an agent's loop over /v1/completions: each prompt "
                        "the one before and a line more (the first the long text), or the "
                        "chats as Responses API requests (the system prompt as instructions)")
    p.add_argument("--long-reps", type=int, default=1,
                   help="rounds over the long sizes (targets rotated); medians reported")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="before the long prompts, seconds with no requests to measure each "
                   "router's CPU per second on its own (0: not measured)")
    p.add_argument("--stream-tokens", type=int, default=0,
                   help="also stream answers of this many tokens (loadtest.overhead_stream)")
    p.add_argument("--stream-requests", type=int, default=100, help="streams per round")
    p.add_argument("--stream-concurrency", type=int, default=4)
    p.add_argument("--stream-reps", type=int, default=3, help="rounds of streams")
    p.add_argument("--decode-ms", type=float, default=0.0,
                   help="the workers' ms per output token (paces streamed answers)")
    p.add_argument("--own-core", action="store_true",
                   help="run the sequential rounds again with each router on a core of its "
                   "own and the client and the workers on the others (loadtest.cpu_pin)")
    p.add_argument("--profile", type=Path, help="py-spy our gateway; collapsed stacks to FILE")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="also write the markdown to this file")
    args = p.parse_args(argv)
    if min(args.workers, args.prefixes, args.requests, args.concurrency, args.reps,
           args.sequential, args.procs, args.long_reps, args.stream_requests,
           args.stream_concurrency, args.stream_reps) < 1 or min(args.stream_tokens,
                                                                 args.decode_ms) < 0:
        p.error("counts must be >= 1")
    unknown = set(args.routers.split(",")) - set(ROUTERS)
    if unknown:
        p.error(f"unknown routers {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    config = OverheadConfig(
        workers=args.workers, prefixes=args.prefixes, requests=args.requests,
        concurrency=args.concurrency, reps=args.reps, sequential=args.sequential,
        routers=tuple(r for r in args.routers.split(",") if r), procs=args.procs,
        gateway_args=tuple(args.gateway_arg), request_logs=args.request_logs,
        long_chars=tuple(int(c) for c in args.long.split(",") if c.strip()),
        long_requests=args.long_requests, long_reps=args.long_reps, idle_s=args.idle_s,
        long_text=args.long_text, long_unique=args.long_unique, long_api=args.long_api,
        long_sessions=args.long_sessions,
        api=args.api,
        stream=StreamConfig(tokens=args.stream_tokens, requests=args.stream_requests,
                            concurrency=args.stream_concurrency, reps=args.stream_reps),
        decode_ms=args.decode_ms, own_core=args.own_core,
        variants=tuple(
            (label, tuple(shlex.split(extra)))
            for label, _, extra in (v.partition("=") for v in args.variant)
        ),
    )
    command = shlex.join(["python", "-m", "loadtest.bench_overhead", *args_list])
    try:
        result = asyncio.run(run_bench(config, command, args.profile))
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
        print(f"bench_overhead: {exc}", file=sys.stderr)
        return 1
    if args.profile is not None and args.profile.exists():
        result.profile_top = top_functions(args.profile.read_text("utf-8", "replace"))
    emit(to_markdown(result), json.dumps(asdict(result), indent=2), args.out,
         as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
