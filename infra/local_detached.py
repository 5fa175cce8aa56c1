"""Detached local workers that register themselves in the store: ``local up|scale|down|status``.

Unlike ``local serve`` (foreground, static membership), these commands leave reference workers
running in the background as their own process groups, each started with
``python -m worker --store URL --public-url URL`` so it registers (with heartbeats) in the
metadata store; any gateway started with the same ``--store`` picks them up, and drops them,
without a restart. What was started is kept in a state file (``.run/local.json`` by default:
store, model, and each worker's pid, port and log file), so later commands find their
processes; a worker stopped with SIGTERM deregisters at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from infra.procs import PortLedger, wait_healthy


@dataclass
class WorkerProc:
    pid: int
    port: int
    url: str
    log: str


@dataclass
class LocalState:
    store: str
    host: str = "127.0.0.1"
    model: str = "sim-model"
    cache_blocks: int = 2048
    worker_args: list[str] = field(default_factory=list)
    workers: list[WorkerProc] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, raw: str) -> LocalState:
        data: dict[str, Any] = json.loads(raw)
        workers = [WorkerProc(**w) for w in data.pop("workers", [])]
        return cls(**data, workers=workers)


def _state_path(run_dir: Path) -> Path:
    return run_dir / "local.json"


def load_state(run_dir: Path) -> LocalState | None:
    path = _state_path(run_dir)
    return LocalState.from_json(path.read_text()) if path.exists() else None


def save_state(run_dir: Path, state: LocalState) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = _state_path(run_dir).with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(_state_path(run_dir))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0); reap it if it is one.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def _start_worker(state: LocalState, run_dir: Path) -> WorkerProc:
    port = PortLedger(host=state.host).take()
    url = f"http://{state.host}:{port}"
    log = run_dir / f"worker-{port}.log"
    cmd = [
        sys.executable, "-m", "worker", "--host", state.host, "--port", str(port),
        "--model", state.model, "--cache-blocks", str(state.cache_blocks),
        "--store", state.store, "--public-url", url, *state.worker_args,
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return WorkerProc(proc.pid, port, url, str(log))


async def _wait_all(workers: list[WorkerProc], timeout_s: float) -> None:
    async def one(w: WorkerProc) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not alive(w.pid):
                raise RuntimeError(f"worker on port {w.port} exited; see {w.log}")
            try:
                await wait_healthy(w.url, timeout_s=0.5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
    await asyncio.gather(*(one(w) for w in workers))


def stop_workers(workers: list[WorkerProc], grace_s: float = 10.0) -> None:
    """SIGTERM to all (a clean stop deregisters), then SIGKILL whoever is left after
    ``grace_s``."""
    for w in workers:
        if alive(w.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(w.pid) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for w in workers:
        if alive(w.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)


def scale(run_dir: Path, n: int, *, state: LocalState | None = None,
          timeout_s: float = 60.0) -> LocalState:
    """Start or stop workers until ``n`` run; the newest are stopped first."""
    if n < 0:
        raise ValueError("the number of workers must be >= 0")
    state = state or load_state(run_dir)
    if state is None:
        raise RuntimeError(f"nothing running from {run_dir}: run 'local up' first")
    state.workers = [w for w in state.workers if alive(w.pid)]
    run_dir.mkdir(parents=True, exist_ok=True)
    started: list[WorkerProc] = []
    try:
        while len(state.workers) + len(started) < n:
            started.append(_start_worker(state, run_dir))
        asyncio.run(_wait_all(started, timeout_s))
    except BaseException:
        stop_workers(started, grace_s=2)
        raise
    state.workers += started
    stop_workers(state.workers[n:])  # the newest go first
    del state.workers[n:]
    save_state(run_dir, state)
    return state


def up(run_dir: Path, n: int, *, store: str, host: str = "127.0.0.1", model: str = "sim-model",
       cache_blocks: int = 2048, worker_args: list[str] | None = None) -> LocalState:
    existing = load_state(run_dir)
    if existing is not None and any(alive(w.pid) for w in existing.workers):
        raise RuntimeError(f"workers from {run_dir} are running: use 'local scale' or "
                           "'local down'")
    state = LocalState(store=store, host=host, model=model, cache_blocks=cache_blocks,
                       worker_args=list(worker_args or []))
    return scale(run_dir, n, state=state)


def down(run_dir: Path) -> int:
    state = load_state(run_dir)
    if state is None:
        return 0
    stop_workers(state.workers)
    _state_path(run_dir).unlink(missing_ok=True)
    return len(state.workers)


async def _health(workers: list[WorkerProc]) -> list[bool]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
        async def one(w: WorkerProc) -> bool:
            try:
                async with http.get(w.url + "/health") as r:
                    return r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False
        return list(await asyncio.gather(*(one(w) for w in workers)))


def status(run_dir: Path) -> str:
    state = load_state(run_dir)
    if state is None:
        return f"no local workers started from {run_dir}"
    healthy = asyncio.run(_health(state.workers))
    lines = [f"{len(state.workers)} worker(s), store {state.store}, model {state.model}",
             f"  {'pid':>7}  {'url':<28} {'state':<8} log"]
    for w, ok in zip(state.workers, healthy, strict=True):
        label = "healthy" if ok else ("running" if alive(w.pid) else "exited")
        lines.append(f"  {w.pid:>7}  {w.url:<28} {label:<8} {w.log}")
    return "\n".join(lines)
