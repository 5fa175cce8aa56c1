"""Peer routers for side-by-side benchmarks: sglang-router and smg in ``cache_aware`` mode.

Both are Rust routers from PyPI (the optional ``peers`` extra: ``pip install '.[peers]'``) that
put a character-level radix tree of recently routed prompts in front of a list of worker URLs.
:func:`running_peer` starts one of them on loopback in front of the given workers, waits until it
has probed and activated every worker (``GET /readiness`` reports them all healthy), yields its
URL and process id, and stops it afterwards. The reference worker answers the probes they send
(``/health``, ``/server_info``, ``/model_info`` and their ``get_`` aliases).

Everything else is the peers' own defaults, as a user would run them: retries, circuit breaker,
balance thresholds (64 in flight and 1.5x), cache threshold 0.3, tree eviction.

:func:`proc_tree_cpu_s` reads a router's CPU time (its process and descendants, every thread,
in nanoseconds where the kernel gives them), so a benchmark can charge each router its own CPU
per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from infra.procs import PortLedger, stop_processes
from loadtest.cpu_pin import process_tree

# name -> the PyPI release the benchmarks were run with (the `peers` extra pins the same).
PEERS: dict[str, str] = {"sglang-router": "0.3.2", "smg": "1.13.0"}
# name -> its Python module. Both wheels install an ``smg`` console script (sglang-router 0.3's
# points at sglang_router), so whichever was installed last owns it: the module is unambiguous.
PEER_MODULES: dict[str, str] = {"sglang-router": "sglang_router", "smg": "smg"}
READY_TIMEOUT_S = 60.0


def peer_variant(spec: str) -> tuple[str, list[str]]:
    """A peer run with arguments of its own, ``PEER[LABEL]=ARGS`` (``smg[tight]=--balance-abs-
    threshold 4``): the router's name in reports (``smg[tight]``) and its extra arguments.
    Raises ``ValueError`` for a spec of another form or an unknown peer."""
    name, sep, args = spec.partition("=")
    match = re.fullmatch(r"([a-z-]+)\[([\w.-]+)\]", name.strip())
    if not sep or match is None:
        raise ValueError(f"a peer variant is PEER[LABEL]=ARGS, not {spec!r}")
    if match.group(1) not in PEERS:
        raise ValueError(f"unknown peer {match.group(1)!r}; choose from {', '.join(PEERS)}")
    return name.strip(), shlex.split(args)


def base_peer(router: str) -> str:
    """The peer a router name runs (``smg[tight]`` -> ``smg``)."""
    return router.partition("[")[0]


class PeerUnavailableError(RuntimeError):
    """The peer's binary is not installed, or it did not become ready."""


@dataclass(frozen=True, slots=True)
class PeerProcess:
    name: str
    url: str
    pid: int
    log_path: Path


def peer_binary(name: str) -> str | None:
    """The peer's executable: next to this interpreter (a venv's bin/) or on PATH."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def peer_launcher(name: str) -> list[str] | None:
    """The command that runs peer ``name``: ``python -m <module>`` when this interpreter has
    its module, else its executable; None when neither is there."""
    module = PEER_MODULES.get(name, "")
    if module and importlib.util.find_spec(module) is not None:
        return [sys.executable, "-m", module]
    binary = peer_binary(name)
    return [binary] if binary is not None else None


def available_peers() -> list[str]:
    """The peers installed here, in :data:`PEERS` order."""
    return [name for name in PEERS if peer_launcher(name) is not None]


def peer_command(launcher: str | Sequence[str], host: str, port: int, metrics_port: int,
                 worker_urls: Sequence[str], extra: Sequence[str] = (),
                 request_logs: bool = False) -> list[str]:
    """``<launcher> launch`` in cache_aware mode in front of ``worker_urls``. With
    ``request_logs`` at its default log level (``info``: two lines per request, as our
    gateway's one access line); without, at ``warn`` (none)."""
    head = [launcher] if isinstance(launcher, str) else list(launcher)
    return [
        *head, "launch", "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", "cache_aware",
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),
        "--log-level", "info" if request_logs else "warn",
        *extra,
    ]


def gateway_log_args(request_logs: bool) -> list[str]:
    """Our gateway's arguments beside the peers: its access line per request goes as their
    request logs do (:func:`peer_command`), so the routers' CPU compares like with like."""
    return [] if request_logs else ["--access-log", "off"]


def proc_tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and all its live descendants, every thread's, exited ones too.

    Read from each process's CPU-time clock in nanoseconds (``clock_gettime`` on the clock
    id Linux gives a process: every thread's time on a CPU, those that have exited
    included), so that 100 requests of 0.3 ms each read as 30 ms and not as 3 clock ticks
    (10 ms each, user + system from ``/proc/<pid>/stat``), which is the fallback.
    """
    total = 0.0
    for p in process_tree(pid):
        exact = _process_cpu_s(p)
        total += _stat_cpu_s(p) if exact is None else exact
    return total


def _stat_cpu_s(pid: int) -> float:
    """``pid``'s user + system time in clock ticks from ``/proc/<pid>/stat`` (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    # Fields after the command name, which is in parentheses and may contain spaces.
    rest = raw[raw.rindex(b")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float | None:
    """``pid``'s CPU-time clock (all its threads, in ns); None where it cannot be read."""
    # Linux: the clock id of a process's CPU time is ((~pid) << 3) | CPUCLOCK_SCHED (2).
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError, AttributeError):
        return None


async def wait_ready(url: str, workers: int, proc: asyncio.subprocess.Process,
                     timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll ``/readiness`` until the router reports ``workers`` healthy workers."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            if proc.returncode is not None:
                raise PeerUnavailableError(f"{url}: the router exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(url + "/readiness") as response:
                    data = await response.json(content_type=None)
                if isinstance(data, dict) and int(data.get("healthy_workers", 0)) >= workers:
                    return
            if time.monotonic() > deadline:
                raise PeerUnavailableError(
                    f"{url}: fewer than {workers} healthy workers after {timeout_s:.0f}s"
                )
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def running_peer(
    name: str, worker_urls: Sequence[str], log_dir: Path, *, host: str = "127.0.0.1",
    port: int = 0, extra: Sequence[str] = (), request_logs: bool = False, log_name: str = "",
) -> AsyncIterator[PeerProcess]:
    """Start peer ``name`` (with ``extra`` arguments) in front of ``worker_urls``, wait until it
    is ready, stop it after.

    Its output goes to ``log_dir/<log_name or name>.log``. Raises
    :class:`PeerUnavailableError` when the binary is missing or the router does not get ready
    in time (the log tail is in the message).
    """
    launcher = peer_launcher(name)
    if launcher is None:
        raise PeerUnavailableError(f"{name} is not installed (pip install '.[peers]')")
    ports = PortLedger(host=host)
    port = port or ports.take()
    cmd = peer_command(launcher, host, port, ports.take(), worker_urls, extra, request_logs)
    log_path = log_dir / f"{log_name or name}.log"
    log = await asyncio.to_thread(log_path.open, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
        )
    finally:
        await asyncio.to_thread(log.close)
    url = f"http://{host}:{port}"
    try:
        try:
            await wait_ready(url, len(worker_urls), proc)
        except PeerUnavailableError as exc:
            tail = (await asyncio.to_thread(log_path.read_text, "utf-8", "replace"))[-1500:]
            raise PeerUnavailableError(f"{name}: {exc}\n{tail}") from exc
        yield PeerProcess(name=name, url=url, pid=proc.pid, log_path=log_path)
    finally:
        await stop_processes([proc], grace_s=5.0)
