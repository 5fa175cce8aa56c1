"""The command-line shape later tooling relies on, run as real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import openai
import pytest

from infra.procs import wait_healthy
from tests.conftest import MODEL, free_ports


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        pytest.param("gateway", ["--host", "--port", "--worker", "--policy", "GATEWAY_"],
                     id="gateway"),
        pytest.param("worker", ["--host", "--port", "--engine", "--cache-blocks",
                                "--block-size", "WORKER_"], id="worker"),
        pytest.param("infra", ["local"], id="infra"),
    ],
)
def test_help_lists_the_documented_flags(module: str, expected: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for flag in expected:
        assert flag in out, f"{flag} missing from python -m {module} --help"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        pytest.param(["--policy", "nope", "--worker", "http://127.0.0.1:1"], {},
                     "unknown policy", id="bad-policy-flag"),
        pytest.param(["--worker", "http://127.0.0.1:1"], {"GATEWAY_POLICY": "nope"},
                     "unknown policy", id="bad-policy-env"),
        pytest.param([], {}, "--worker", id="no-worker"),
    ],
)
def test_gateway_rejects_bad_settings_with_exit_2(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    proc = subprocess.run([sys.executable, "-m", "gateway", *argv], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode == 2
    assert message in proc.stderr


async def test_local_serve_runs_gateway_and_workers_until_interrupted() -> None:
    # Three consecutive free ports: the gateway's, then the workers'. A worker port picked as
    # "one past a free port" can be some client's ephemeral port at that moment.
    gateway_port = free_ports(3)
    worker_base = gateway_port + 1
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infra", "local", "serve", "--workers", "2",
        "--port", str(gateway_port), "--worker-base-port", str(worker_base),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{gateway_port}"
    seen: list[bytes] = []

    async def banner() -> None:
        """Until the command says it is ready (it finds the gateway healthy on its own
        polling, which may come after ours)."""
        assert proc.stdout is not None
        while b"Press Ctrl-C to stop." not in (line := await proc.stdout.readline()):
            assert line, b"".join(seen).decode()  # it exited before saying so
            seen.append(line)
        seen.append(line)

    try:
        # The banner first: if the command exits instead, its output is the failure message.
        await asyncio.wait_for(banner(), 120)
        await wait_healthy(base, timeout_s=60)
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=3) as oa:
            # The gateway may still be probing its workers right after /health answers.
            for _ in range(50):
                if (await oa.models.list()).data:
                    break
                await asyncio.sleep(0.1)
            raw = await oa.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-route-worker"].startswith("127.0.0.1:")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = (b"".join(seen) + out).decode()
    assert proc.returncode == 0, text
    assert "curl" in text
    assert base in text
    # Every child is gone: the worker ports refuse connections now.
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", worker_base)
