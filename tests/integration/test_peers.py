"""sglang-router and smg started by loadtest.peers in front of reference workers (skipped when
the optional peers are not installed)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.contracts.httpserver import JsonErrorRunner
from loadtest.peers import (
    PEERS,
    base_peer,
    peer_binary,
    peer_command,
    peer_variant,
    proc_tree_cpu_s,
    running_peer,
)
from worker.server import create_app
from worker.settings import WorkerSettings

PROMPT = "The shared instructions of this benchmark tenant, repeated. " * 20


async def start_workers(count: int) -> tuple[list[str], list[web.AppRunner]]:
    urls: list[str] = []
    runners: list[web.AppRunner] = []
    for i in range(count):
        settings = WorkerSettings(port=0, model="sim-model", cache_blocks=256,
                                  prefill_us_per_token=0, decode_ms_per_token=0,
                                  worker_id=f"w{i}")
        runner = JsonErrorRunner(create_app(settings))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    return urls, runners


@pytest.fixture
async def workers() -> AsyncIterator[list[str]]:
    urls, runners = await start_workers(2)
    try:
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


def test_unknown_peer_and_cpu_seconds() -> None:
    with pytest.raises(ValueError, match="unknown peer"):
        peer_binary("nginx")
    before = proc_tree_cpu_s(os.getpid())
    sum(i * i for i in range(200_000))
    assert proc_tree_cpu_s(os.getpid()) >= before > 0


def test_peer_variant_names_a_peer_and_its_arguments() -> None:
    name, args = peer_variant("smg[tight]=--balance-abs-threshold 4 --balance-rel-threshold 1.2")
    assert (name, base_peer(name)) == ("smg[tight]", "smg")
    assert args == ["--balance-abs-threshold", "4", "--balance-rel-threshold", "1.2"]
    cmd = peer_command(["smg"], "127.0.0.1", 1, 2, ["http://127.0.0.1:3"], args)
    assert cmd[-4:] == args
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    for bad in ("smg=--x 1", "smg[t]", "smg[a b]=--x"):
        with pytest.raises(ValueError, match="PEER\\[LABEL\\]=ARGS"):
            peer_variant(bad)
    with pytest.raises(ValueError, match="unknown peer"):
        peer_variant("nginx[t]=--x 1")


async def test_peer_routes_repeated_prompt_to_its_holder(
    workers: list[str], tmp_path: Path
) -> None:
    # One peer is enough to check the launcher and the probes (both peers share one code base
    # and start in seconds each, so the test stays short).
    installed = [name for name in PEERS if peer_binary(name) is not None]
    if not installed:
        pytest.skip("no peer router installed (optional extra 'peers')")
    name = installed[-1]
    served, matched = [], []
    async with running_peer(name, workers, tmp_path) as peer, aiohttp.ClientSession() as session:
        assert proc_tree_cpu_s(peer.pid) >= 0
        for suffix in ("first question", "second question", "third question"):
            body = {"model": "sim-model", "prompt": PROMPT + suffix, "max_tokens": 1}
            async with session.post(peer.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                served.append(resp.headers["x-worker-id"])
                matched.append(int(resp.headers["x-cache-matched-tokens"]))
    assert len(set(served)) == 1  # cache_aware keeps a shared prefix on one worker
    assert matched[0] == 0
    assert min(matched[1:]) > 0
