"""``python -m worker --engine vllm -- <vllm serve args>``: run vLLM as a registered worker.

A sidecar around ``vllm serve``:

1. starts it with what affinity routing needs, unless the arguments already say otherwise:
   ``--enable-prefix-caching``, ``--prefix-caching-hash-algo sha256_cbor`` (block hashes that
   are reproducible across processes), ``--enable-prompt-tokens-details`` (so responses carry
   ``usage.prompt_tokens_details.cached_tokens``), ``--served-model-name``, host and port, and a
   fixed ``PYTHONHASHSEED`` (vLLM seeds its first block hash from it); with ``--kv-events``
   (and ``--kv-replay``), ``--kv-events-config`` so that vLLM publishes its KV-cache events
   there, and the registration advertises them to gateways;
2. waits for ``/health``, reads the KV cache geometry from ``vllm:cache_config_info`` on
   ``/metrics`` (block size and number of blocks = the capacity gateways weight it by);
3. registers the server in the metadata store (kind ``vllm``) and heartbeats while it runs;
4. on SIGTERM/SIGINT, or when vLLM exits, deregisters and stops vLLM (SIGTERM, then SIGKILL
   after a grace period).

The binary is a setting (``--vllm-binary``), so tests run this launcher with our reference
worker standing in for ``vllm serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import sys
from collections.abc import Sequence

import aiohttp

from gateway.contracts.worker_record import WorkerRecord
from worker.register import registered
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def vllm_command(settings: WorkerSettings, args: Sequence[str]) -> list[str]:
    """The ``vllm serve`` command line: the user's arguments plus what routing relies on."""
    cmd = [*shlex.split(settings.vllm_binary), "serve", *args]

    def ensure(flag: str, *value: str) -> None:
        if not any(a == flag or a.startswith(flag + "=") for a in args):
            cmd.extend((flag, *value))

    ensure("--host", settings.host)
    ensure("--port", str(settings.port))
    ensure("--served-model-name", settings.model)
    if settings.data_parallel_size > 1:
        ensure("--data-parallel-size", str(settings.data_parallel_size))
    ensure("--enable-prefix-caching")
    ensure("--prefix-caching-hash-algo", "sha256_cbor")
    ensure("--enable-prompt-tokens-details")
    if settings.kv_events:
        config: dict[str, object] = {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": settings.kv_events, "buffer_steps": settings.kv_events_buffer,
        }
        if settings.kv_replay:
            config["replay_endpoint"] = settings.kv_replay
        ensure("--kv-events-config", json.dumps(config, separators=(",", ":")))
    return cmd


def parse_cache_info(metrics_text: str) -> tuple[int, int] | None:
    """(num_gpu_blocks, block_size) from vLLM's ``vllm:cache_config_info``, if present."""
    match = _CACHE_INFO.search(metrics_text)
    if match is None:
        return None
    labels = dict(_LABEL.findall(match.group("labels")))
    try:
        return int(float(labels["num_gpu_blocks"])), int(float(labels["block_size"]))
    except (KeyError, ValueError):
        return None


async def _wait_ready(
    base: str, proc: asyncio.subprocess.Process, timeout_s: float
) -> tuple[int, int] | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"vllm exited with code {proc.returncode} while starting")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(base + "/health") as health:
                    if health.status == 200:
                        async with http.get(base + "/metrics") as metrics:
                            return parse_cache_info(await metrics.text())
            if loop.time() > deadline:
                raise TimeoutError(f"vllm did not answer /health within {timeout_s:.0f}s")
            await asyncio.sleep(0.5)


async def _stop(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def launch(settings: WorkerSettings, vllm_args: Sequence[str]) -> int:
    cmd = vllm_command(settings, vllm_args)
    env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    log.info("starting: %s", shlex.join(cmd))
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, env=env)
    except OSError as exc:
        print(f"python -m worker --engine vllm: cannot start vllm ({cmd[0]}): {exc}",
              file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    base = f"http://{'127.0.0.1' if settings.host in ('0.0.0.0', '') else settings.host}"
    base += f":{settings.port}"
    try:
        # Leaving this block deregisters (if registered), before vLLM is stopped below.
        async with contextlib.AsyncExitStack() as registration:
            ready = asyncio.create_task(_wait_ready(base, proc, settings.startup_timeout_s))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                return 0
            stopped.cancel()
            geometry = ready.result()
            blocks, block_size = geometry if geometry else (0, settings.block_size)
            print(f"vllm ready at {base} ({blocks} KV blocks of {block_size} tokens)", flush=True)
            if settings.store:
                kv_events, kv_replay = settings.kv_events, settings.kv_replay
                record = WorkerRecord(
                    id=settings.effective_worker_id, url=settings.effective_public_url,
                    models=(settings.model,), capacity_blocks=blocks, block_size=block_size,
                    kind="vllm",
                    kv_events=settings.advertised(kv_events) if kv_events else "",
                    kv_replay=settings.advertised(kv_replay) if kv_replay else "",
                )
                await registration.enter_async_context(registered(
                    settings.store, record, every_s=settings.heartbeat_s,
                    ttl_s=settings.registry_ttl_s, prefix=settings.store_prefix,
                ))
            exited = asyncio.create_task(proc.wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait([exited, stopped], return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                print(f"vllm exited with code {proc.returncode}", file=sys.stderr)
                return 1
            return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"python -m worker --engine vllm: {exc}", file=sys.stderr)
        return 1
    finally:
        await _stop(proc, grace_s=30.0)
