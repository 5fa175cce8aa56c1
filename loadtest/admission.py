"""``python -m loadtest admission``: what keys and limits cost, and how a batch is counted.

Starts one reference worker and, side by side on it, an open gateway and one with 1,000 keys
in a salted keys file, per-tenant limits high enough never to refuse; sends the same small
requests to both, interleaved, and reports median latencies. Then sends one 64-prompt batch
and compares the load the gateway counts for it with the work the worker reports (prompt plus
completion tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.api import request_cost
from gateway.app import create_app as create_gateway
from gateway.auth import hash_key
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import parse_completion
from gateway.settings import GatewaySettings
from infra.procs import PortLedger
from loadtest.fuzz import _serve
from worker.server import create_app as create_worker
from worker.settings import WorkerSettings

WORKER = WorkerSettings(prefill_us_per_token=5.0, prefill_us_per_cached_token=0.5,
                        decode_ms_per_token=1.0)


async def _timed(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 headers: dict[str, str]) -> float:
    started = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - started


async def measure(requests: int, keys: int) -> dict[str, Any]:
    runners: list[web.AppRunner] = []
    ports = PortLedger()
    try:
        wport = ports.take()
        runners.append(await _serve(create_worker(dataclasses.replace(WORKER, port=wport)),
                                    wport))
        worker = (f"http://127.0.0.1:{wport}",)
        with tempfile.TemporaryDirectory() as tmp:
            keys_file = Path(tmp) / "keys"
            keys_file.write_text("".join(f"t{i} {hash_key(f'sk-{i}')}\n" for i in range(keys)))
            open_port, keyed_port = ports.take(), ports.take()
            runners.append(await _serve(create_gateway(GatewaySettings(
                port=open_port, worker=worker)), open_port))
            runners.append(await _serve(create_gateway(GatewaySettings(
                port=keyed_port, worker=worker, api_keys_file=str(keys_file),
                tenant_rpm=1e9, tenant_tpm=1e12, tenant_concurrency=1000,
                max_inflight=1000)), keyed_port))
        latencies: dict[str, list[float]] = {"open": [], "keys+limits": []}
        last_key = {"Authorization": f"Bearer sk-{keys - 1}"}  # the last line of the file
        async with aiohttp.ClientSession() as http:
            for i in range(requests):
                body = {"model": WORKER.model, "prompt": f"request {i} " * 8, "max_tokens": 1}
                for name, port, headers in (("open", open_port, {}),
                                            ("keys+limits", keyed_port, last_key)):
                    latencies[name].append(await _timed(
                        http, f"http://127.0.0.1:{port}/v1/completions", body, headers))
            batch = {"model": WORKER.model, "max_tokens": 16,
                     "prompt": [f"document {i}: " + "lorem ipsum dolor sit amet " * 10
                                for i in range(64)]}
            async with http.post(f"http://127.0.0.1:{open_port}/v1/completions",
                                 json=batch) as r:
                usage = (await r.json())["usage"]
        parsed = parse_completion(batch, NormalizeOptions())
        settings = GatewaySettings()
        first_only = math.ceil(len(parsed.fingerprint_text) / settings.chars_per_token) + 16
        return {
            "requests_each": requests,
            "keys_in_file": keys,
            "median_ms": {k: round(statistics.median(v) * 1000, 2)
                          for k, v in latencies.items()},
            "batch_64": {
                "counted_before_tokens": first_only,
                "counted_now_tokens": request_cost(parsed, settings)[1],
                "worker_prompt_plus_completion_tokens":
                    usage["prompt_tokens"] + usage["completion_tokens"],
            },
        }
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest admission", description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.requests, args.keys)), indent=2))
    return 0
