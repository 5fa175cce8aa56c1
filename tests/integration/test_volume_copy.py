"""The volume guard moves a heavy session by copying it first: through the real gateway in
front of reference workers over HTTP, a session whose holder is over the guard stays there
while a prefill-only copy of its whole prompt goes to another worker, and its next turn goes
to that copy and finds all of it in the worker's cache (nothing redone on a request's path).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.conftest import MODEL, StartCluster, admin_workers, until

BASE = "Tool schema and house rules of a coding agent, kept verbatim in every turn. " * 27
TURN = "Observation: the build failed at step N; the agent reads the log and retries. " * 5


async def _complete(http: aiohttp.ClientSession, gateway: str,
                    prompt: str) -> tuple[str, str, int, int]:
    """The chosen worker, the route reason, and the prompt tokens the worker found cached
    and was sent."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(gateway + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
        return (response.headers["x-route-worker"], response.headers["x-route-reason"],
                int(response.headers["x-cache-matched-tokens"]),
                int(response.headers["x-cache-input-tokens"]))


async def _prewarm_stats(http: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with http.get(gateway + "/admin/workers") as response:
        stats: dict[str, Any] = (await response.json())["prewarm"]
        return stats


async def test_a_session_over_the_volume_guard_moves_to_a_copy_of_itself(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=4, volume_guard=1.2)
    gateway = cluster.gateway_url
    async with aiohttp.ClientSession() as http:
        await until(lambda: _all_up(http, gateway))
        prompt = BASE
        holder, _, _, _ = await _complete(http, gateway, prompt)
        copied_to = ""
        copied_tokens = 0  # the copied prompt's tokens, as the holder's engine counted them
        for _ in range(8):  # the session's turns, each extending the last, until one is copied
            prompt += TURN
            worker, reason, _, copied_tokens = await _complete(http, gateway, prompt)
            assert worker == holder, reason  # never moved cold
            if "session copied to " in reason:
                copied_to = reason.rsplit("session copied to ", 1)[1].rstrip(")")
                break
        assert copied_to
        assert copied_to != holder

        async def placed() -> bool:
            stats = await _prewarm_stats(http, gateway)
            return bool(stats["placed"] >= 1 and stats["copies_done"] >= 1)

        await until(placed)
        stats = await _prewarm_stats(http, gateway)
        assert (stats["sessions"], stats["used"], stats["copies_done"]) == (1, 0, 1)
        assert stats["copy_seconds"] > 0  # the time from its decision to its answer

        prompt += TURN  # the next turn goes to the copy, which holds the whole last turn
        worker, reason, cached, sent = await _complete(http, gateway, prompt)
        assert worker == copied_to, reason
        assert reason.startswith("prefix_hit")
        assert cached >= copied_tokens - 16  # every full block of the copied prompt
        assert cached < sent
        assert (await _prewarm_stats(http, gateway))["used"] == 1  # the copy paid off


async def _all_up(http: aiohttp.ClientSession, gateway: str) -> bool:
    workers = await admin_workers(http, gateway)
    return len(workers) == 4 and all(w["healthy"] for w in workers.values())


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "no-refresh"])
async def test_a_session_moves_only_to_a_copy_holding_all_of_it(
        start_cluster: StartCluster, refresh: bool) -> None:
    """A long session over the guard moves from copy to copy. A copy made some turns ago
    lacks the turns since: with ``volume_refresh`` the holder keeps the turn and the copy is
    brought up to date first (sent to that copy's worker again), so every move finds the
    whole last prompt cached; without it the session moves to the stale copy at once and
    that turn redoes what the copy lacks."""
    cluster = await start_cluster(workers=4, volume_guard=1.2, volume_refresh=refresh)
    gateway = cluster.gateway_url
    async with aiohttp.ClientSession() as http:
        await until(lambda: _all_up(http, gateway))

        async def copies_over() -> bool:  # every session copy sent has been answered
            stats = await _prewarm_stats(http, gateway)
            return bool(stats["sessions"] == stats["copies_done"])

        held: dict[str, int] = {}  # the most of the session's prompt each worker was sent
        prompt, last_worker, last_tokens = BASE, "", 0
        refreshed = diverted = 0
        redone: list[int] = []  # tokens a move's worker lacked of the last turn's prompt
        for _ in range(30):
            worker, reason, cached, tokens = await _complete(http, gateway, prompt)
            if last_worker and worker != last_worker:
                redone.append(last_tokens - cached)
            if "session copied to " in reason:
                copied_to = reason.rsplit("session copied to ", 1)[1].rstrip(")")
                assert copied_to != worker
                if 0 < held.get(copied_to, 0) < tokens:
                    refreshed += 1  # an earlier copy or holder, brought up to date
                held[copied_to] = tokens
            diverted += reason.startswith("diverted")
            held[worker] = tokens
            last_worker, last_tokens = worker, tokens
            await until(copies_over)  # a copy is answered before the next turn
            prompt += TURN
        assert len(redone) >= 3  # the session moved
        assert (await _prewarm_stats(http, gateway))["copies_waited"] == 0  # each one sent
        if refresh:
            assert refreshed >= 1
            assert diverted == 0
            assert max(redone) < 16  # at most a partial block of the last prompt redone
        else:
            assert diverted >= 1
            assert max(redone) >= 16 * 10  # a stale copy's lacking turns redone on the path
