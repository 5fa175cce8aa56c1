"""Process control for local clusters and benchmarks: free ports, start-and-wait, stop.

Servers (``python -m worker``, ``python -m gateway``, ``redis-server``, ...) run as child
processes on loopback. :func:`start_server` starts one and waits until its ``/health`` answers
200, failing at once (with the tail of its log, when it has one) if it exits first;
:func:`stop_processes` stops them all: SIGTERM to every one first, then each is waited for up to
a grace period and killed after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shlex
import signal
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import aiohttp

HOST = "127.0.0.1"


def checkout_in(args: Sequence[str]) -> str:
    """The DIR of an ``@DIR`` among a variant's ``args`` ("" when there is none)."""
    return next((a[1:] for a in args if a.startswith("@")), "")


def from_checkout(cmd: list[str], source: str) -> list[str]:
    """``cmd`` (a ``python -m ...`` command) run from the checkout in ``source`` (its modules
    found first), or as it is when ``source`` is empty: how benchmarks set a change beside the
    code before it in one run."""
    if not source:
        return cmd
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    return ["env", "-C", source, f"PYTHONPATH={path}", *cmd]


def ports_free(ports: Iterable[int], host: str = HOST) -> bool:
    """Whether every port in ``ports`` can be bound on ``host`` now."""
    socks: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's server does
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def listen_ports(low: int = 10_000) -> range:
    """The ports a server here may take without racing the kernel's outgoing connections.

    ``bind(port 0)`` picks from the range the kernel also gives outgoing connections their
    local ports from, so between a probe's close and the server's own bind a client's
    connection can take the port ("address already in use"). Ports under that range are
    never taken that way; where the range leaves too few of them, every port from ``low``.
    """
    try:
        floor = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        floor = 32_768
    return range(low, floor) if floor - low >= 4_096 else range(low, 65_536)


class PortLedger:
    """Free loopback ports for the servers one process starts, never the same one twice.

    The ledger walks :func:`listen_ports` from a random start and remembers how far it went,
    so servers started one after the other each get a port of their own even before the
    earlier ones have bound theirs.
    """

    def __init__(self, ports: range | None = None, host: str = HOST) -> None:
        self._ports = ports if ports is not None else listen_ports()
        self._host = host
        self._next = random.randrange(self._ports.start, self._ports.stop)

    def take(self, size: int = 1) -> int:
        """The first of ``size`` consecutive ports free now, none of them given out before."""
        for _ in range(len(self._ports)):
            base = self._next
            if base + size > self._ports.stop:
                base = self._ports.start
            self._next = base + size
            if ports_free(range(base, base + size), self._host):
                return base
        raise RuntimeError(f"no block of {size} free ports in {self._ports}")


def free_port_block(size: int, preferred: int = 0) -> int:
    """The first of ``size`` consecutive ports free on loopback now (``preferred`` if it is)."""
    if preferred:
        if ports_free(range(preferred, preferred + size)):
            return preferred
        raise RuntimeError(f"ports {preferred}-{preferred + size - 1} are not all free")
    return PortLedger().take(size)


async def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    """Poll ``url``/health until it answers 200; raise TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f}s")
            await asyncio.sleep(0.1)


async def start_server(
    cmd: Sequence[str], url: str, log_path: Path | None, procs: list[asyncio.subprocess.Process],
    timeout_s: float = 30.0,
) -> None:
    """Start one server, append it to ``procs`` and wait until it answers /health.

    Its output goes to ``log_path`` (``None``: this process's own stdout and stderr)."""
    if log_path is None:
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL)
    else:
        log = await asyncio.to_thread(log_path.open, "wb")
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
            )
        finally:
            await asyncio.to_thread(log.close)  # the child keeps its own copy of the descriptor
    procs.append(proc)
    healthy = asyncio.create_task(wait_healthy(url, timeout_s))
    exited = asyncio.create_task(proc.wait())
    done, _ = await asyncio.wait([healthy, exited], return_when=asyncio.FIRST_COMPLETED)
    healthy.cancel()
    exited.cancel()
    if healthy in done:
        healthy.result()  # re-raises a timeout
        return
    message = f"{shlex.join(cmd[1:5])} exited with code {proc.returncode}"
    if log_path is not None:
        tail = (await asyncio.to_thread(log_path.read_text, "utf-8", "replace"))[-2000:]
        message += f":\n{tail}"
    raise RuntimeError(message)


async def stop_processes(
    procs: Sequence[asyncio.subprocess.Process], grace_s: float = 10.0
) -> None:
    """SIGTERM to every process still running, then wait ``grace_s`` for each, then SIGKILL."""
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
