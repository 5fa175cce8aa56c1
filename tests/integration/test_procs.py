"""``python -m gateway --procs 2``: two processes on one port that keep affinity through the hub."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp
import pytest

from loadtest.replay import agreement, agreement_sample
from tests.conftest import MODEL, Processes

PREFIX = "You answer questions about the rail tariff, and only from it. " * 20


async def _until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def _fresh() -> aiohttp.ClientSession:
    """One connection per request, so the kernel spreads them over the processes."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_processes_share_one_port_and_the_prefix_index(
    processes: Processes, store: str, request: pytest.FixtureRequest
) -> None:
    """With the embedded store (the parent's hub) or Redis: either way the processes send
    each other their decisions as they make them."""
    workers = [(await processes.worker())[0] for _ in range(3)]
    args = [a for url in workers for a in ("--worker", url)]
    if store == "redis":
        args += ["--store", request.getfixturevalue("redis_server").url]
    gateway = await processes.gateway("--procs", "2", *args)
    views: dict[str, dict[str, Any]] = {}

    async with _fresh() as http:
        async def both_processes_answer() -> bool:
            async with http.get(gateway + "/admin/rebalance") as r:
                view = await r.json()
            views[view["replica"]] = view
            return len(views) == 2
        await _until(both_processes_answer)

        async def chat(i: int) -> dict[str, str]:
            async with http.post(gateway + "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1,
                "messages": [{"role": "system", "content": PREFIX},
                             {"role": "user", "content": f"question {i}"}],
            }) as r:
                assert r.status == 200, await r.text()
                return dict(r.headers)

        first = await chat(0)
        owner = first["x-route-worker"]
        learned: set[str] = set()
        links: dict[str, dict[str, int]] = {}

        async def every_process_knows_the_prefix() -> bool:
            async with http.get(gateway + "/admin/rebalance") as r:
                view = await r.json()
            if view["workers"][owner]["held_blocks"] > 0:
                learned.add(view["replica"])
                links[view["replica"]] = view["peers"]
            return learned == set(views)
        # One process routed the prefix; the other learns it from the decision it was sent.
        await _until(every_process_knows_the_prefix)
        assert sorted(link["sent"] + link["received"] for link in links.values()) == [1, 1]

        replies = [await chat(i) for i in range(1, 13)]
        # Dry runs of one more request on both processes: the same view, the same worker.
        body = {"model": MODEL, "max_tokens": 1, "prompt": PREFIX + "question 13"}
        pairs = await agreement_sample(http, gateway, body, tries=24)
    assert {h["x-route-worker"] for h in replies} == {owner}
    assert all(int(h["x-prefix-match-blocks"]) > 0 for h in replies)
    assert any(p.across for p in pairs)
    assert all(p.same_view and p.agreed for p in pairs)
    assert agreement(pairs, across=True) == 1.0

    await processes.stop_all()
    pids = [int(replica.rsplit(":", 1)[1]) for replica in views]

    async def replicas_gone() -> bool:
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            return False
        return True
    await _until(replicas_gone, timeout_s=15)


async def test_a_stored_response_made_on_one_process_is_continued_on_any(
    processes: Processes,
) -> None:
    """Each request on a new connection, so the kernel spreads them over the two processes:
    a next turn by previous_response_id finds the pin wherever the answer was relayed (the
    chance that all 12 next turns meet the process that pinned their answer is 1 in 4,096)."""
    workers = [(await processes.worker())[0] for _ in range(3)]
    gateway = await processes.gateway(
        "--procs", "2", *(a for url in workers for a in ("--worker", url)))

    async def post(body: dict[str, Any]) -> tuple[str, str]:
        async with _fresh() as http, http.post(gateway + "/v1/responses", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["id"], r.headers["x-route-worker"]

    async def serving() -> bool:  # both processes, as far as 8 new connections can tell
        for _ in range(8):
            async with _fresh() as http, http.get(gateway + "/ready") as r:
                if r.status != 200:
                    return False
        return True
    await _until(serving)
    for i in range(6):
        last, home = await post({"model": MODEL, "input": f"{PREFIX} ticket {i}",
                                 "max_output_tokens": 1})
        for turn in range(2):
            last, worker = await post({"model": MODEL, "previous_response_id": last,
                                       "input": f"and then {turn}?", "max_output_tokens": 1})
            assert worker == home
