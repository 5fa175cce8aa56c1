"""``python -m loadtest fuzz``: schemathesis against a live gateway, counting every status.

Starts fast reference workers and a gateway with an API key on loopback (in this process),
points schemathesis (``st run``, a subprocess) at the gateway's ``/openapi.json`` with the
``not_a_server_error`` check, and counts the status of every response the gateway sent. The
schema's ``model`` lists the served model, so generated requests reach the workers as well as
the gateway's own validation. Exit status 0 means no 5xx and no schemathesis failure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.contracts.httpserver import JsonErrorRunner
from gateway.settings import GatewaySettings
from infra.procs import PortLedger
from worker.server import create_app as create_worker
from worker.settings import WorkerSettings

KEY = "sk-fuzz"
# Decoding costs nothing and sequences are short, so a case takes milliseconds.
FUZZ_WORKER = WorkerSettings(
    prefill_us_per_token=1.0, prefill_us_per_cached_token=0.0, decode_ms_per_token=0.0,
    max_model_len=2048,
)
_GENERATED = re.compile(r"(\d+) generated")


@dataclass
class FuzzResult:
    command: str
    cases: int
    returncode: int
    seconds: float
    statuses: dict[str, int] = field(default_factory=dict)  # "2xx"/"4xx"/"5xx" -> responses
    worker_statuses: dict[str, int] = field(default_factory=dict)  # what reached the workers
    output_tail: str = ""

    @property
    def server_errors(self) -> int:
        return self.statuses.get("5xx", 0) + self.worker_statuses.get("5xx", 0)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.server_errors == 0


def schemathesis_binary() -> str:
    found = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    if not Path(found).exists():
        raise RuntimeError("schemathesis is not installed: pip install -e '.[dev]'")
    return found


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = JsonErrorRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def body_operations(document: dict[str, Any]) -> int:
    """The operations of an OpenAPI document that take a request body."""
    return sum(1 for item in document.get("paths", {}).values()
               for op in item.values() if isinstance(op, dict) and "requestBody" in op)


async def _body_operations(port: int) -> int:
    """:func:`body_operations` of the document the gateway on ``port`` serves (at least 1)."""
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/openapi.json") as response:
        response.raise_for_status()
        return max(1, body_operations(await response.json()))


async def fuzz(cases: int, *, seed: int = 1, workers: int = 2, st_workers: int = 1,
               timeout_s: float = 3600.0) -> FuzzResult:
    """Run schemathesis against a fresh gateway and count statuses: about ``cases`` cases in
    its fuzzing phase, spread over the operations that take a body (the GETs have no
    inputs), and its coverage phase's own on top."""
    runners: list[web.AppRunner] = []
    statuses: Counter[str] = Counter()
    worker_statuses: Counter[str] = Counter()

    async def count(request: web.Request, response: web.StreamResponse) -> None:
        statuses[f"{response.status // 100}xx"] += 1

    async def count_worker(request: web.Request, response: web.StreamResponse) -> None:
        if request.path.startswith("/v1/") and request.method == "POST":
            worker_statuses[f"{response.status // 100}xx"] += 1

    ports = PortLedger()
    try:
        urls = []
        for _ in range(workers):
            port = ports.take()
            settings = dataclasses.replace(FUZZ_WORKER, port=port)
            worker_app = create_worker(settings)
            worker_app.on_response_prepare.append(count_worker)
            runners.append(await _serve(worker_app, port))
            urls.append(f"http://127.0.0.1:{port}")
        gport = ports.take()
        app = create_gateway(GatewaySettings(port=gport, worker=tuple(urls),
                                             api_key=(f"{KEY}:fuzz",)))
        app.on_response_prepare.append(count)
        runners.insert(0, await _serve(app, gport))
        per_operation = max(1, math.ceil(cases / await _body_operations(gport)))
        argv = [
            schemathesis_binary(), "run", f"http://127.0.0.1:{gport}/openapi.json",
            "-H", f"Authorization: Bearer {KEY}", "--checks", "not_a_server_error",
            "-n", str(per_operation), "--seed", str(seed), "--no-color",
            "--suppress-health-check", "all", "--generation-database", "none",
            "--phases", "coverage,fuzzing", "--workers", str(st_workers),
            "--wait-for-schema", "30",
        ]
        started = time.perf_counter()
        scratch = tempfile.TemporaryDirectory()  # schemathesis keeps a cache in its cwd
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=scratch.name)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            out, _ = await proc.communicate()
        seconds = time.perf_counter() - started
        scratch.cleanup()
        text = out.decode("utf-8", "replace")
        found = _GENERATED.findall(text)
        shown = " ".join(a if not a.startswith("Authorization") else "Authorization: Bearer ***"
                         for a in argv[1:])
        return FuzzResult(
            command=f"st {shown}", cases=int(found[-1]) if found else 0,
            returncode=proc.returncode if proc.returncode is not None else -1,
            seconds=seconds, statuses=dict(sorted(statuses.items())),
            worker_statuses=dict(sorted(worker_statuses.items())),
            output_tail=text[-4000:],
        )
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest fuzz",
        description="schemathesis against a live gateway with reference workers; counts 5xx",
    )
    parser.add_argument("--cases", type=int, default=10_000, help="about this many test cases")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--st-workers", type=int, default=1,
                        help="schemathesis's concurrent workers")
    parser.add_argument("--json", default="", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    result = asyncio.run(fuzz(args.cases, seed=args.seed, st_workers=args.st_workers))
    summary = {k: v for k, v in asdict(result).items() if k != "output_tail"}
    print(result.output_tail[-1500:])
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if result.ok else 1
