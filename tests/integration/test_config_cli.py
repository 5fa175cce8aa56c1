"""``python -m gateway --config FILE`` as a user runs it: settings come from the file, flags
still win, and each request leaves one JSON access line on stdout."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from infra.procs import stop_processes, wait_healthy
from tests.conftest import MODEL, Processes, free_port


async def test_gateway_reads_its_config_file(processes: Processes, tmp_path: Path) -> None:
    worker_url, _ = await processes.worker()
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'port = {port + 1}\npolicy = "least_load"\nworker = ["{worker_url}"]\n'
                      'max-attempts = 2\naccess_log = "json"\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--config", str(config), "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, timeout_s=60)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/admin/workers") as r:
                view = await r.json()
            async with http.post(url + "/v1/completions", headers={"x-request-id": "cfg-1"},
                                 json={"model": MODEL, "prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 200
                assert r.headers["x-route-policy"] == "least_load"
        assert view["policy"] == "least_load"
        assert [w["url"] for w in view["workers"]] == [worker_url]
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        while b"cfg-1" not in line:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        entry = json.loads(line)
        assert entry["request_id"] == "cfg-1"
        assert entry["policy"] == "least_load"
        assert entry["status"] == 200
    finally:
        await stop_processes([proc], grace_s=10)
