"""Local clusters: reference workers (and a gateway) as child processes on this machine.

``python -m infra local serve --workers 4`` is the project's main job: four ``python -m worker``
processes and one ``python -m gateway`` in front of them on the embedded metadata store, served
until Ctrl-C, then stopped cleanly (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field

from gateway.settings import GatewaySettings
from infra.procs import start_server, stop_processes, wait_healthy

# Re-exported for loadtest.replay and loadtest.chaos_load, which still import them from here
# (infra.procs is their home).
__all__ = ["DEFAULT_POLICY", "LocalCluster", "sample_curl", "serve", "stop_processes",
           "wait_healthy"]

DEFAULT_POLICY = GatewaySettings().policy  # the gateway's own default


@dataclass(frozen=True, slots=True)
class LocalCluster:
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    worker_base_port: int = 8001
    workers: int = 4
    policy: str = DEFAULT_POLICY  # "": the gateway decides (its --config file, else its default)
    model: str = "sim-model"
    cache_blocks: int = 2048
    worker_args: tuple[str, ...] = field(default_factory=tuple)
    gateway_args: tuple[str, ...] = field(default_factory=tuple)
    # Data-parallel engine ranks per worker (``--data-parallel-size``), each a worker of its
    # own for the gateway (``#dp-size=N`` on its URL).
    dp_size: int = 1

    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.worker_base_port + i}" for i in range(self.workers)]

    def worker_commands(self) -> list[list[str]]:
        return [
            [
                sys.executable, "-m", "worker", "--host", self.host,
                "--port", str(self.worker_base_port + i), "--model", self.model,
                "--cache-blocks", str(self.cache_blocks),
                *(("--data-parallel-size", str(self.dp_size)) if self.dp_size > 1 else ()),
                *self.worker_args,
            ]
            for i in range(self.workers)
        ]

    def gateway_command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "gateway", "--host", self.host,
            "--port", str(self.gateway_port), *self.gateway_args,
        ]
        if self.policy:
            cmd += ["--policy", self.policy]
        ranks = f"#dp-size={self.dp_size}" if self.dp_size > 1 else ""
        for url in self.worker_urls():
            cmd += ["--worker", url + ranks]
        return cmd


def sample_curl(base: str, model: str) -> str:
    return (
        f"curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"system\", \"content\": "
        f"\"You are a helpful assistant.\"}}, {{\"role\": \"user\", \"content\": \"Hello!\"}}]}}' "
        f"-D - -o /dev/null | grep -i '^x-'"
    )


async def _run_until_stopped(cluster: LocalCluster, procs: list[asyncio.subprocess.Process],
                             stop: asyncio.Event) -> int:
    await asyncio.gather(*(
        start_server(cmd, url, None, procs)
        for cmd, url in zip(cluster.worker_commands(), cluster.worker_urls(), strict=True)
    ))
    base = f"http://{cluster.host}:{cluster.gateway_port}"
    await start_server(cluster.gateway_command(), base, None, procs)
    policy = cluster.policy or "from its settings"
    print(
        f"\nGateway ready at {base}/v1 (OpenAI-compatible), policy {policy}, "
        f"{cluster.workers} workers on ports {cluster.worker_base_port}-"
        f"{cluster.worker_base_port + cluster.workers - 1}"
        + (f", {cluster.dp_size} engine ranks each" if cluster.dp_size > 1 else "") + ".\n"
        f"Try:\n{sample_curl(base, cluster.model)}\n"
        f"Worker view: curl -s {base}/admin/workers   Metrics: {base}/metrics\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )
    waiters = [asyncio.create_task(p.wait()) for p in procs]
    await asyncio.wait([asyncio.create_task(stop.wait()), *waiters],
                       return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        return 0
    print("a server exited on its own; stopping the cluster", file=sys.stderr)
    return 1


async def serve(cluster: LocalCluster) -> int:
    """Start the cluster, print how to use it, and wait for Ctrl-C / SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    procs: list[asyncio.subprocess.Process] = []
    main = asyncio.create_task(_run_until_stopped(cluster, procs, stop))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([main, stopper], return_when=asyncio.FIRST_COMPLETED)
        if main.done():
            return main.result()
        main.cancel()
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"python -m infra: {exc}", file=sys.stderr)
        return 1
    finally:
        stopper.cancel()
        print("stopping...", flush=True)
        await stop_processes(procs)
