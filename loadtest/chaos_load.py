"""The steady load and the processes behind ``python -m loadtest chaos``.

:class:`Load` keeps ``concurrency`` clients busy against one gateway (closed loop, half of them
streaming), records every request (start, end, streaming or not, success), and can pause.
:class:`ChaosCluster` runs the real processes the faults act on: a ``redis-server``, reference
workers that register in it, and one gateway on the store, each a child process that can be
signalled (SIGKILL, SIGSTOP/SIGCONT, SIGTERM) and started again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from infra.local import LocalCluster, stop_processes
from loadtest.bench_gateway import (
    AFFINITY_WORKER_ARGS,
    HOST,
    MODEL,
    free_port_block,
    start_server,
    wait_all_workers_up,
)
from loadtest.bench_replicas import start_redis

SYSTEM_PROMPTS = tuple(
    f"You are assistant number {i} of a travel agency. Answer in short sentences, quote the "
    f"fare rules when asked, and never promise refunds. " * 8
    for i in range(8)
)
_SAMPLE = re.compile(r"^([a-z_:]+)(?:\{[^}]*\})?\s+([-+0-9.e]+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Sample:
    start: float
    end: float
    stream: bool
    ok: bool
    error: str = ""


@dataclass(slots=True)
class Load:
    """Closed-loop clients against ``gateway``; every request recorded as a :class:`Sample`."""

    gateway: str
    concurrency: int
    max_tokens: int
    seed: int = 0
    samples: list[Sample] = field(default_factory=list)
    _running: asyncio.Event = field(default_factory=asyncio.Event)
    _stopped: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None
    inflight: int = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._running.set()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    def pause(self) -> None:
        self._running.clear()

    async def drained(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no request of this load is in flight."""
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:  # noqa: ASYNC110 - a polled count
            await asyncio.sleep(0.05)

    def resume(self) -> None:
        self._running.set()

    async def stop(self) -> None:
        """Stop sending; wait for the requests in flight to end."""
        self._stopped = True
        self._running.set()
        await asyncio.gather(*self._tasks)
        if self._session is not None:
            await self._session.close()

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        stream = i % 2 == 1
        n = 0
        while not self._stopped:
            await self._running.wait()
            if self._stopped:
                return
            n += 1
            body = {
                "model": MODEL, "max_tokens": self.max_tokens, "stream": stream,
                "messages": [
                    {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                    {"role": "user", "content": f"client {i} question {n}: {rng.random()}"},
                ],
            }
            start = time.monotonic()
            self.inflight += 1
            try:
                ok, error = await self._send(body, stream)
            finally:
                self.inflight -= 1
            self.samples.append(Sample(start, time.monotonic(), stream, ok, error))
            if not ok:
                await asyncio.sleep(0.05)  # a refused connection must not become a hot loop

    async def _send(self, body: dict[str, object], stream: bool) -> tuple[bool, str]:
        assert self._session is not None
        try:
            async with self._session.post(
                self.gateway + "/v1/chat/completions", json=body
            ) as response:
                payload = await response.read()
                if response.status != 200:
                    return False, f"HTTP {response.status}"
                if not stream:
                    return bool(json.loads(payload).get("choices")), ""
                if b'"error"' in payload:
                    return False, "stream error event"
                return payload.rstrip().endswith(b"data: [DONE]"), ""
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return False, type(exc).__name__


async def abort_burst(
    gateway: str, workers: Sequence[str], clients: int, max_tokens: int
) -> tuple[int, int]:
    """``clients`` streaming requests at once, all dropped by their clients together half a
    second after the workers hold (nearly) all of them, running or queued (at most 30 s).
    Returns (requests the workers held, clients whose stream had started)."""
    started = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(k: int) -> None:
            nonlocal started
            body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
                    "messages": [{"role": "system", "content": SYSTEM_PROMPTS[k % 8]},
                                 {"role": "user", "content": f"long story {k}"}]}
            async with session.post(gateway + "/v1/chat/completions", json=body) as response:
                if response.status == 200 and await response.content.readany():
                    started += 1
                await asyncio.Event().wait()

        tasks = [asyncio.create_task(one(k)) for k in range(clients)]
        deadline = time.monotonic() + 30.0
        held = 0
        while time.monotonic() < deadline:
            held = 0
            for url in workers:
                metrics = await scrape(session, url)
                held += int(metrics.get("vllm:num_requests_running", 0.0)
                            + metrics.get("vllm:num_requests_waiting", 0.0))
            if held >= 0.95 * clients:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return held, started


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Sums of every sample in a Prometheus page, by metric name (0 if unreachable)."""
    out: dict[str, float] = {}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.get(url + "/metrics") as response:
            text = await response.text()
        for name, value in _SAMPLE.findall(text):
            out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass(slots=True)
class ChaosCluster:
    """Redis, ``workers`` self-registering reference workers and one gateway, as processes."""

    workers: int
    gateway_args: tuple[str, ...]
    worker_args: tuple[str, ...] = ()
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="chaos-")))
    redis: list[asyncio.subprocess.Process] = field(default_factory=list)
    worker_procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    gateway_procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    base: int = 0

    @property
    def redis_port(self) -> int:
        return self.base

    @property
    def store(self) -> str:
        return f"redis://{HOST}:{self.base}/0"

    @property
    def gateway(self) -> str:
        return f"http://{HOST}:{self.base + 1}"

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://{HOST}:{self.base + 2 + i}" for i in range(self.workers)]

    def _local(self) -> LocalCluster:
        return LocalCluster(
            host=HOST, gateway_port=self.base + 1, worker_base_port=self.base + 2,
            workers=self.workers, model=MODEL,
            worker_args=(*AFFINITY_WORKER_ARGS, "--store", self.store, *self.worker_args),
            gateway_args=("--store", self.store, *self.gateway_args),
        )

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.base = free_port_block(2 + self.workers)
        await self.start_redis()
        local = self._local()
        # One list per worker, so that worker_procs[i] serves worker_urls[i] whatever order
        # the processes started in.
        procs: list[list[asyncio.subprocess.Process]] = [[] for _ in range(self.workers)]
        try:
            await asyncio.gather(*(
                start_server([*cmd, "--public-url", url], url, self.logs / f"worker{i}.log",
                             procs[i])
                for i, (cmd, url) in enumerate(
                    zip(local.worker_commands(), local.worker_urls(), strict=True))
            ))
        finally:
            self.worker_procs = [proc for started in procs for proc in started]
        await self.start_gateway()
        await wait_all_workers_up(session, self.gateway, self.workers)

    async def start_redis(self) -> None:
        self.redis = []
        await start_redis(self.redis_port, self.logs / "redis.log", self.redis)

    async def start_gateway(self) -> None:
        # workers=0: no --worker flags; the gateway finds the workers in the registry.
        local = dataclasses.replace(self._local(), workers=0)
        await start_server(local.gateway_command(), self.gateway, self.logs / "gateway.log",
                           self.gateway_procs)

    def logged_errors(self) -> int:
        """Lines at ERROR level in the gateway's and the workers' logs so far."""
        return sum(
            sum(1 for line in path.read_text("utf-8", "replace").splitlines()
                if " ERROR " in line)
            for path in self.logs.glob("*.log")
        )

    def signal_worker(self, i: int, sig: signal.Signals) -> None:
        self.worker_procs[i].send_signal(sig)

    def signal_gateway(self, sig: signal.Signals) -> asyncio.subprocess.Process:
        proc = self.gateway_procs[-1]
        proc.send_signal(sig)
        return proc

    def signal_redis(self, sig: signal.Signals) -> asyncio.subprocess.Process:
        proc = self.redis[-1]
        proc.send_signal(sig)
        return proc

    async def flushall(self) -> None:
        reader, writer = await asyncio.open_connection(HOST, self.redis_port)
        writer.write(b"FLUSHALL\r\n")
        await writer.drain()
        await reader.readline()
        writer.close()

    async def stop(self) -> None:
        for procs in (self.worker_procs, self.gateway_procs, self.redis):
            for proc in procs:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGCONT)
        await stop_processes([*self.gateway_procs, *self.worker_procs], grace_s=5.0)
        await stop_processes(self.redis, grace_s=5.0)

