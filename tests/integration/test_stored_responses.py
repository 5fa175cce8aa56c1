"""Stored Responses API answers through the gateway: a next turn by ``previous_response_id``
reaches the worker that stored the last one (pinned, whatever its prefix would pick), and so do
``GET`` / ``DELETE /v1/responses/{id}`` and its input items; per tenant; across gateways that
share a real redis-server. The official ``openai`` client, reference workers that store their
answers as vLLM's response store does."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from gateway.app import create_app as create_gateway
from gateway.contracts.responses import response_id_in
from gateway.settings import GatewaySettings
from tests.conftest import MODEL, RedisServer, StartCluster, free_port, serve

KEYS = ("sk-acme-1:acme", "sk-globex-1:globex")
# Different openings, so that prefix routing alone would spread them over the workers.
OPENINGS = [f"Ticket {i}: the customer's {topic} needs attention. " * 8 for i, topic in
            enumerate(["derailleur", "headset", "bottom bracket", "hub", "rim", "saddle"])]


def client(base_url: str, key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def test_next_turns_by_id_reach_the_worker_that_stored_the_last(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=4)
    homes: set[str] = set()
    async with client(cluster.base_url) as oa:
        for opening in OPENINGS:
            raw = await oa.responses.with_raw_response.create(
                model=MODEL, input=opening, max_output_tokens=3)
            last, home = raw.parse(), raw.headers["x-route-worker"]
            homes.add(home)
            for turn in range(3):
                # Only the new input: the conversation is the worker's.
                raw = await oa.responses.with_raw_response.create(
                    model=MODEL, previous_response_id=last.id,
                    input=f"And step {turn}?", max_output_tokens=3)
                assert raw.headers["x-route-worker"] == home
                assert raw.headers["x-route-policy"] == "cache_aware"
                assert raw.headers["x-route-reason"].startswith("pinned: stored response")
                last = raw.parse()
                assert last.output_text
                assert last.usage is not None
                # The worker ran the whole conversation, whose beginning it had cached.
                assert last.usage.input_tokens > 3 * len(opening) // 8
                assert last.usage.input_tokens_details.cached_tokens > 0
    assert len(homes) > 1  # the conversations were spread; each one stayed home


async def test_a_stored_response_is_retrieved_listed_and_deleted_through_the_gateway(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=3)
    async with client(cluster.base_url) as oa:
        made = await oa.responses.create(model=MODEL, input=OPENINGS[0], max_output_tokens=4)
        got = await oa.responses.retrieve(made.id)
        assert (got.id, got.output_text) == (made.id, made.output_text)
        items = await oa.responses.input_items.list(made.id)
        assert [item.type for item in items.data] == ["message"]
        await oa.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await oa.responses.retrieve(made.id)
        assert gone.value.code == "response_not_found"
        with pytest.raises(openai.BadRequestError) as continued:
            await oa.responses.create(model=MODEL, previous_response_id=made.id, input="more")
        assert continued.value.param == "previous_response_id"
        assert continued.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            await oa.responses.retrieve("resp_never_made")


async def test_a_streamed_response_is_pinned_before_the_client_sees_its_id(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=4)
    async with client(cluster.base_url) as oa, aiohttp.ClientSession() as http:
        for opening in OPENINGS[:3]:
            async with oa.responses.with_streaming_response.create(
                    model=MODEL, input=opening, max_output_tokens=3, stream=True) as raw:
                home = raw.headers["x-route-worker"]
                created_id = ""
                async for line in raw.iter_lines():
                    if not created_id and line.startswith("data:"):
                        created_id = response_id_in((line + "\n").encode()) or ""
                        if created_id:
                            # Asked for at once, while the stream is still open: the request
                            # reaches its worker (which stores it once complete).
                            # (Same key: open mode takes each bearer value for a tenant.)
                            async with http.get(f"{cluster.base_url}/responses/{created_id}",
                                                headers={"Authorization": "Bearer k"}) as r:
                                assert r.headers["x-route-worker"] == home
            assert created_id
            nxt = await oa.responses.with_raw_response.create(
                model=MODEL, previous_response_id=created_id, input="go on",
                max_output_tokens=2)
            assert nxt.headers["x-route-worker"] == home
            assert nxt.parse().output_text


async def test_store_false_keeps_nothing(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2)
    async with client(cluster.base_url) as oa:
        made = await oa.responses.create(model=MODEL, input="hi", store=False,
                                         max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await oa.responses.retrieve(made.id)


async def test_tenants_never_reach_each_others_responses(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2, api_key=KEYS)
    async with client(cluster.base_url, "sk-acme-1") as acme, \
            client(cluster.base_url, "sk-globex-1") as globex:
        made = await acme.responses.create(model=MODEL, input=OPENINGS[1], max_output_tokens=2)
        assert (await acme.responses.retrieve(made.id)).id == made.id
        with pytest.raises(openai.NotFoundError):
            await globex.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await globex.responses.delete(made.id)
        with pytest.raises(openai.BadRequestError) as continued:
            await globex.responses.create(model=MODEL, previous_response_id=made.id,
                                          input="what did they ask?")
        assert continued.value.code == "previous_response_not_found"
        assert (await acme.responses.retrieve(made.id)).id == made.id  # still there
    async with aiohttp.ClientSession() as http, \
            http.get(f"{cluster.base_url}/responses/{made.id}") as r:
        assert r.status == 401  # no key: nothing is looked up


async def test_the_pinned_worker_down_is_a_503_and_no_other_worker_is_tried(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=3, max_attempts=3)
    async with client(cluster.base_url) as oa:
        raw = await oa.responses.with_raw_response.create(
            model=MODEL, input=OPENINGS[2], max_output_tokens=2)
        made, home = raw.parse(), raw.headers["x-route-worker"]
        await cluster.stop_worker(next(u for u in cluster.worker_urls if u.endswith(
            home.rpartition(":")[2])))
        for attempt in (
                oa.responses.create(model=MODEL, previous_response_id=made.id, input="more"),
                oa.responses.retrieve(made.id)):
            with pytest.raises((openai.InternalServerError, openai.APIStatusError)) as failed:
                await attempt
            assert failed.value.status_code in (502, 503)
        # Other conversations go on.
        other = await oa.responses.create(model=MODEL, input=OPENINGS[3], max_output_tokens=2)
        assert other.output_text


async def test_bad_ids_are_400s_naming_the_parameter(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    async with aiohttp.ClientSession() as http:
        for previous in (3, "", "x" * 300):
            body: dict[str, Any] = {"model": MODEL, "input": "hi",
                                    "previous_response_id": previous}
            async with http.post(cluster.base_url + "/responses", json=body) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"]["param"] == "previous_response_id"


async def test_gateways_sharing_redis_find_each_others_responses(
        start_cluster: StartCluster, redis_server: RedisServer) -> None:
    cluster = await start_cluster(workers=3, store=redis_server.url)
    port = free_port()
    second = await serve(create_gateway(GatewaySettings(
        port=port, worker=tuple(cluster.worker_urls), store=redis_server.url)), port)
    try:
        async with client(cluster.base_url) as first_gw, \
                client(f"http://127.0.0.1:{port}/v1") as second_gw:
            raw = await first_gw.responses.with_raw_response.create(
                model=MODEL, input=OPENINGS[4], max_output_tokens=2)
            made, home = raw.parse(), raw.headers["x-route-worker"]
            for _ in range(50):  # until the second gateway has probed its workers
                async with aiohttp.ClientSession() as http, \
                        http.get(f"http://127.0.0.1:{port}/ready") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert (await second_gw.responses.retrieve(made.id)).id == made.id
            nxt = await second_gw.responses.with_raw_response.create(
                model=MODEL, previous_response_id=made.id, input="go on",
                max_output_tokens=2)
            assert nxt.headers["x-route-worker"] == home
    finally:
        await second.cleanup()


def test_the_response_id_is_read_from_a_whole_answer_or_a_streams_first_event() -> None:
    whole = b'{"id": "resp_1", "object": "response", "output": []}'
    assert response_id_in(whole) == "resp_1"
    created = (b'event: response.created\ndata: {"type": "response.created", '
               b'"response": {"id": "resp_2", "object": "response"}}\n\n')
    assert response_id_in(created) == "resp_2"
    assert response_id_in(created[:40]) is None  # not all there yet
    assert response_id_in(created[:-1]) == "resp_2"
    assert response_id_in(created[:-2]) is None  # its line may not be complete yet
    assert response_id_in(b'{"object": "chat.completion", "id": "chatcmpl-1"}') is None
    assert response_id_in(b'{"created_at": 1, "id": "resp_3", "object": "response"}') == "resp_3"
    assert response_id_in(b'{"id" : "resp_4" ,"created_at": 1}') == "resp_4"
    assert response_id_in(b"not json") is None


async def test_without_redis_pins_hold_in_the_process_and_unknown_ids_are_503s(
        start_cluster: StartCluster, redis_server: RedisServer) -> None:
    cluster = await start_cluster(workers=2, store=redis_server.url)
    async with client(cluster.base_url) as oa:
        before = await oa.responses.create(model=MODEL, input=OPENINGS[5], max_output_tokens=2)
        redis_server.stop()
        # Made while the store is gone: pinned in this process, and answered all the same.
        made = await oa.responses.create(model=MODEL, input=OPENINGS[0], max_output_tokens=2)
        for known in (before, made):
            nxt = await oa.responses.create(model=MODEL, previous_response_id=known.id,
                                            input="go on", max_output_tokens=2)
            assert nxt.output_text
        # Only the store could say where this one is: not a 404, a 503 to retry.
        with pytest.raises(openai.APIStatusError) as unknown:
            await oa.responses.retrieve("resp_made_by_another_gateway")
        assert unknown.value.status_code == 503


async def test_a_streamed_next_turn_is_pinned_in_turn(start_cluster: StartCluster) -> None:
    """A chain of turns, each streamed and each continuing the last by its id."""
    cluster = await start_cluster(workers=4)
    async with client(cluster.base_url) as oa:
        raw = await oa.responses.with_raw_response.create(
            model=MODEL, input=OPENINGS[3], max_output_tokens=2)
        last, home = raw.parse().id, raw.headers["x-route-worker"]
        for turn in range(3):
            async with oa.responses.with_streaming_response.create(
                    model=MODEL, previous_response_id=last, input=f"step {turn}?",
                    max_output_tokens=2, stream=True) as streamed:
                assert streamed.headers["x-route-worker"] == home
                ids = [response_id_in((line + "\n").encode())
                       async for line in streamed.iter_lines() if line.startswith("data:")]
            last = next(i for i in ids if i)
        got = await oa.responses.retrieve(last)
        assert got.id == last
        assert got.output_text


async def test_without_pins_such_requests_are_the_engines_to_answer(
        start_cluster: StartCluster) -> None:
    """--response-pin-ttl-s 0 (engines that share their store): next turns and lookups go
    where routing sends them, and an unknown id is the engine's answer, not the gateway's."""
    cluster = await start_cluster(workers=1, response_pin_ttl_s=0.0)
    async with client(cluster.base_url) as oa:
        made = await oa.responses.create(model=MODEL, input=OPENINGS[1], max_output_tokens=2)
        nxt = await oa.responses.with_raw_response.create(
            model=MODEL, previous_response_id=made.id, input="more", max_output_tokens=2)
        assert not nxt.headers["x-route-reason"].startswith("pinned")
        assert (await oa.responses.retrieve(made.id)).id == made.id
        with pytest.raises(openai.NotFoundError) as unknown:  # the worker's 404
            await oa.responses.create(model=MODEL, previous_response_id="resp_unknown",
                                      input="more")
        assert unknown.value.code == "previous_response_not_found"
