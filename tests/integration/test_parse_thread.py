"""Requests of very many items are parsed on a thread (``--parse-thread-items``) and answered
exactly as the event loop's parse would have them: same forwarded body, same routing key, the
same 400 for the same mistake."""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.api import STATE
from tests.conftest import MODEL, Cluster, StartCluster


def _parses(cluster: Cluster) -> int:
    app = cluster.runners["gateway"].app
    assert app is not None
    return app[STATE].parse_pool.parsed


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        return r.status, await r.json(), r.headers.get("x-prefix-anchor", "")


async def test_many_items_are_parsed_on_the_thread_as_on_the_loop(
    start_cluster: StartCluster,
) -> None:
    threaded = await start_cluster(workers=1, parse_thread_items=8)
    on_loop = await start_cluster(workers=1, parse_thread_items=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are\u00a0terse.\u200b  "},
        *({"role": "user" if i % 2 else "assistant", "content": f"turn {i}\r\nline  \n"}
          for i in range(8)),
        {"role": "user", "content": [{"type": "text", "text": "last\u2009question "}]},
    ]
    chat = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": messages}
    batch = {"model": MODEL, "max_tokens": 2, "temperature": 0,
             "prompt": [f"prompt\u00a0{i} " for i in range(9)]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", batch)):
        got = [await _post(c.gateway_url, path, body) for c in (threaded, on_loop)]
        assert got[0][0] == got[1][0] == 200
        assert got[0][2] == got[1][2] != ""  # the same normalized text fingerprinted
        assert got[0][1]["choices"] == got[1][1]["choices"]
        assert got[0][1]["usage"] == got[1][1]["usage"]
    assert _parses(threaded) == 2
    assert _parses(on_loop) == 0
    async with aiohttp.ClientSession() as http, http.get(threaded.gateway_url + "/metrics") as r:
        assert "gateway_thread_parses_total 2.0" in await r.text()
    small = {"model": MODEL, "max_tokens": 1, "messages": messages[:3]}
    assert (await _post(threaded.gateway_url, "/v1/chat/completions", small))[0] == 200
    assert _parses(threaded) == 2  # a few items stay on the loop


async def test_a_mistake_found_on_the_thread_is_the_same_400(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, parse_thread_items=8)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}] * 9
    body = {"model": MODEL, "messages": [*messages, {"role": "robot", "content": "b"}]}
    status, answer, _ = await _post(cluster.gateway_url, "/v1/chat/completions", body)
    assert status == 400
    assert answer["error"]["param"] == "messages[9].role"
    assert answer["error"]["type"] == "invalid_request_error"
    assert _parses(cluster) == 1
