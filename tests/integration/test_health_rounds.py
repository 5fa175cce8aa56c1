"""Health rounds spread over the interval: each server asked once a round, evenly apart, and what
a timed-out probe means when no other probe was answered meanwhile.

The rounds are driven by hand (the gateway's own waits an hour); the engines are small aiohttp
servers in the test's process, or real worker processes stopped with SIGSTOP (the kernel still
accepts their connections, nothing answers).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.health import HealthChecker
from tests.conftest import (
    Processes,
    free_port,
    probed_by_hand,
    probed_engine,
    serve,
    stopped,
)


def _engine(name: str, asked: list[tuple[str, float]],
            stalls: list[float] | None = None) -> web.Application:
    """An engine that answers its probes and notes when it was asked for its health; while
    ``stalls`` holds durations, a health answer first blocks the whole event loop for the
    last of them (the gateway's loop, in this process), as a long garbage collection does."""

    async def health(_: web.Request) -> web.Response:
        asked.append((name, time.monotonic()))
        if stalls:
            time.sleep(stalls.pop())  # noqa: ASYNC251 (the stall is the point)
        return web.json_response({})

    return probed_engine(health=health)


@contextlib.asynccontextmanager
async def _engines(*engines: web.Application) -> AsyncIterator[list[str]]:
    ports = [free_port() for _ in engines]
    runners = [await serve(app, port) for app, port in zip(engines, ports, strict=True)]
    try:
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for runner in runners:
            await runner.cleanup()


async def _round(health: HealthChecker, over_s: float = 0.2) -> None:
    """One spread round, and the answers of its probes applied."""
    assert await health.spread_round(over_s) is False
    await health.answered()


async def test_a_round_asks_each_server_once_and_its_probes_apart() -> None:
    """Four servers, one of them listed as two data-parallel ranks: five workers, four
    servers asked once each in a round of 0.4 s, a tenth of a second apart, not in one burst
    (asyncio's timers never fire early, so the gaps are at least about that)."""
    asked: list[tuple[str, float]] = []
    async with _engines(*(_engine(str(i), asked) for i in range(4))) as urls:
        ranked = [*urls[:3], urls[3] + "#dp-size=2"]
        async with probed_by_hand(*ranked) as (pool, health):
            assert len(pool.healthy_ids()) == 5
            asked.clear()  # the start-up round asked each at once
            await _round(health, 0.4)
            assert sorted(name for name, _ in asked) == ["0", "1", "2", "3"]
            times = sorted(at for _, at in asked)
            assert min(b - a for a, b in itertools.pairwise(times)) > 0.05
            assert len(pool.healthy_ids()) == 5


async def test_a_stall_of_the_gateways_loop_in_a_round_keeps_the_worker_it_delayed() -> None:
    """A probe out while the loop stalls past its timeout (2 s) times out with no other probe
    answered meanwhile: the worker stays, and is asked again at once, which it answers in
    time. The server asked first in the round stalls the loop on that health answer."""
    asked: list[tuple[str, float]] = []
    stalls: dict[str, list[float]] = {"a": [], "b": []}
    async with _engines(_engine("a", asked, stalls["a"]),
                        _engine("b", asked, stalls["b"])) as urls:
        ids = {url.removeprefix("http://") for url in urls}
        first, second = ("a", "b") if urls[0] < urls[1] else ("b", "a")  # a round's order
        async with probed_by_hand(*urls) as (pool, health):
            assert pool.healthy_ids() == ids
            asked.clear()
            stalls[first].append(2.5)
            await _round(health)
            assert pool.healthy_ids() == ids
            assert asked[0][0] == first
            assert sorted(name for name, _ in asked) == sorted([first, first, second])


async def test_a_hung_worker_leaves_within_its_round_and_comes_back(
    processes: Processes,
) -> None:
    """Stopped, a worker leaves in the round that finds it so, whether or not another probe
    was answered while it waited (then its second timeout in a row takes it out); two stopped
    workers both leave; answering again, they come back with the next round."""
    (a_url, a), (b_url, b) = [await processes.worker() for _ in range(2)]
    a_id, b_id = a_url.removeprefix("http://"), b_url.removeprefix("http://")
    async with probed_by_hand(a_url, b_url) as (pool, health):
        assert pool.healthy_ids() == {a_id, b_id}
        async with stopped(a):
            await _round(health)
            assert pool.healthy_ids() == {b_id}
        await _round(health)
        assert pool.healthy_ids() == {a_id, b_id}
        async with stopped(a, b):
            await _round(health)
            assert pool.healthy_ids() == set()
        await _round(health)
        assert pool.healthy_ids() == {a_id, b_id}


async def test_a_worker_is_probed_out_of_turn_at_most_once_an_interval() -> None:
    """``probe_soon`` (a registry entry gone: the worker leaves once a probe finds it down,
    which tests/integration/test_infra_local.py shows) does not ask an endpoint probed within
    the last interval: here the start-up round's, an hour ago at most."""
    asked: list[tuple[str, float]] = []
    async with _engines(_engine("a", asked)) as (url,), probed_by_hand(url) as (pool, health):
        asked.clear()
        health.probe_soon(url.removeprefix("http://"))
        health.probe_soon("no such worker")
        await health.answered()
        assert asked == []
        assert pool.healthy_ids() == {url.removeprefix("http://")}
