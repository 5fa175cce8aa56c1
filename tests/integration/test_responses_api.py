"""OpenAI's Responses API through the gateway: the official ``openai`` client, routed by the chat
the request amounts to (an agent's next turn finds the worker holding the last), streamed
events, errors; reference workers behind it, and a stand-in for what a vLLM worker is sent."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
from aiohttp import web
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
)

from tests.conftest import MODEL, StartCluster, engine_stub, free_port, serve

INSTRUCTIONS = ("You are the assistant of a bicycle repair shop. Answer from the manual: "
                "brakes, gears, wheels, tyres and chains, chapter by chapter. ") * 12


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)


async def test_an_agents_next_turn_goes_where_its_last_turn_is_cached(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=3)
    async with client(cluster.base_url) as oa:
        first_raw = await oa.responses.with_raw_response.create(
            model=MODEL, instructions=INSTRUCTIONS, input="How do I true a wheel?",
            max_output_tokens=4)
        first = first_raw.parse()
        assert first.output_text
        history: list[Any] = [
            {"role": "user", "content": "How do I true a wheel?"},
            {"role": "assistant", "content": [{"type": "output_text",
                                               "text": first.output_text}]},
            {"type": "function_call", "call_id": "c1", "name": "manual",
             "arguments": '{"chapter": "wheels"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "spoke tension ..."},
            {"role": "user", "content": [{"type": "input_text", "text": "And the brakes?"}]},
        ]
        second_raw = await oa.responses.with_raw_response.create(
            model=MODEL, instructions=INSTRUCTIONS, input=history, max_output_tokens=4)
        second = second_raw.parse()
    assert second_raw.headers["x-route-worker"] == first_raw.headers["x-route-worker"]
    assert int(second_raw.headers["x-prefix-match-blocks"]) > 0
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.output_text


async def test_a_response_repeats_the_settings_it_was_given(
        start_cluster: StartCluster) -> None:
    """An agent's request with tools (the model left to choose: the reference worker answers
    in text): its response, and the stored copy read back, repeat its tools, instructions and
    sampling settings, and say OpenAI's defaults for the rest."""
    tools: Any = [{"type": "function", "name": "manual", "description": "read the manual",
                   "parameters": {"type": "object", "properties": {}}}]
    cluster = await start_cluster(workers=1)
    async with client(cluster.base_url) as oa:
        made = await oa.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input="How do I true a wheel?", tools=tools,
            temperature=0.2, max_output_tokens=4, metadata={"ticket": "42"})
        again = await oa.responses.retrieve(made.id)
        plain = await oa.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    for response in (made, again):
        assert response.output_text
        assert [t.name for t in response.tools] == ["manual"]  # type: ignore[union-attr]
        assert response.tool_choice == "auto"
        assert response.instructions == INSTRUCTIONS.rstrip()  # as normalized on the way
        assert response.temperature == 0.2
        assert response.max_output_tokens == 4
        assert response.metadata == {"ticket": "42"}
    assert plain.tools == []
    assert plain.instructions is None
    assert plain.parallel_tool_calls is True
    assert plain.temperature == 1.0


async def test_a_streamed_response_with_the_openai_client(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2)
    async with client(cluster.base_url) as oa:
        stream = await oa.responses.create(model=MODEL, instructions=INSTRUCTIONS,
                                           input="Which tyre pressure?", max_output_tokens=5,
                                           stream=True)
        events = [event async for event in stream]
    assert isinstance(events[0], ResponseCreatedEvent)
    assert isinstance(events[-1], ResponseCompletedEvent)
    deltas = [e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert len(deltas) == 5
    completed = events[-1].response
    assert completed.output_text == "".join(deltas)
    assert completed.usage is not None
    assert completed.usage.input_tokens > 0


async def test_the_worker_gets_the_text_normalized_so_a_clean_copy_hits_its_cache(
        start_cluster: StartCluster) -> None:
    """Invisible differences (NBSP, zero-width spaces, trailing spaces) are normalized in the
    body the worker gets, as in a chat's: what it caches is what the fingerprint saw, and the
    same request written cleanly finds its whole prompt cached."""
    cluster = await start_cluster(workers=2)
    dirty = (INSTRUCTIONS.replace(". ", ".\u00a0", 3).replace("manual", "man\u200bual", 2)
             + "  ")
    async with client(cluster.base_url) as oa:
        first = await oa.responses.with_raw_response.create(
            model=MODEL, instructions=dirty, max_output_tokens=2,
            input=[{"role": "user", "content": [{"type": "input_text",
                                                  "text": "Which chain?  \n"}]}])
        second = await oa.responses.with_raw_response.create(
            model=MODEL, instructions=INSTRUCTIONS, input="Which chain?", max_output_tokens=2)
    assert second.headers["x-route-worker"] == first.headers["x-route-worker"]
    usage = second.parse().usage
    assert usage is not None
    # All of it but the last, partial block (16 tokens) and the next one it ends in.
    assert usage.input_tokens_details.cached_tokens >= usage.input_tokens - 32


async def test_bad_input_names_the_responses_parameter(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
        ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
         "input[0].content[0].text"),
        ({"model": MODEL, "input": "hi", "instructions": 3}, "instructions"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi"}, "model"),
    ]
    async with aiohttp.ClientSession() as http:
        for body, param in cases:
            async with http.post(cluster.base_url + "/responses", json=body) as r:
                assert r.status == 400, (body, await r.text())
                assert (await r.json())["error"]["param"] == param, body


class VLLMResponses:
    """Stands in for a vLLM worker's Responses API: records what it is sent, streams a
    created and a completed event whose response carries the usage."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = engine_stub()

        async def responses(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            done = {"id": "resp_1", "object": "response", "status": "completed",
                    "model": MODEL, "output": [], "usage": {
                        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
                        "output_tokens": 1, "total_tokens": 41}}
            if not body.get("stream"):
                return web.json_response(done)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for event in ({"type": "response.created", "response": {**done, "usage": None}},
                          {"type": "response.completed", "response": done}):
                await response.write(
                    f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
            await response.write_eof()
            return response

        app.router.add_post("/v1/responses", responses)
        return app


async def test_a_vllm_worker_gets_the_request_salted_and_unchanged_otherwise(
        start_cluster: StartCluster) -> None:
    upstream = VLLMResponses()
    port = free_port()
    runner = await serve(upstream.app(), port)
    try:
        cluster = await start_cluster(workers=0, worker=(f"vllm+http://127.0.0.1:{port}",))
        async with aiohttp.ClientSession() as http:
            for stream in (False, True):
                body = {"model": MODEL, "input": "hi", "stream": stream}
                async with http.post(cluster.base_url + "/responses", json=body) as r:
                    assert r.status == 200
                    text = await r.text()
            assert "response.completed" in text  # relayed as it came
            async with http.get(cluster.gateway_url + "/admin/workers") as r:
                (worker,) = (await r.json())["workers"]
    finally:
        await runner.cleanup()
    # The tenant's namespace as vLLM's cache_salt; a stream is not asked for a usage event
    # (a Responses stream always ends with its usage), and is relayed as it came.
    assert all(isinstance(b.get("cache_salt"), str) and b["cache_salt"] for b in upstream.bodies)
    assert all("stream_options" not in b for b in upstream.bodies)
    assert [b["input"] for b in upstream.bodies] == ["hi", "hi"]
    # The usage the worker reported (in the response, and in the stream's completed event)
    # reached the gateway's hit counters.
    assert worker["input_tokens"] == 80
    assert worker["matched_tokens"] == 64


async def test_a_long_agent_loops_next_turns_are_parsed_from_their_new_items(
        start_cluster: StartCluster) -> None:
    """Each turn sends the whole loop again and two items more: the gateway decodes and
    parses only those (its response-history hits count them) and the worker, which gets the
    body as sent, finds the rest cached. (The openai client writes ``input`` before
    ``instructions``, which here end in a space the rules trim: the history is used once the
    instructions are found the same as it was parsed with.)"""
    cluster = await start_cluster(workers=2)
    loop: list[Any] = [{"role": "user", "content": "Fix the failing test."}]
    for i in range(120):
        loop += [{"type": "function_call", "call_id": f"c{i}", "name": "read",
                  "arguments": json.dumps({"path": f"src/f{i}.py"})},
                 {"type": "function_call_output", "call_id": f"c{i}",
                  "output": f"def f{i}():\n    return {i}\n" * 12}]
    async with client(cluster.base_url) as oa, aiohttp.ClientSession() as http:
        for turn in range(4):
            raw = await oa.responses.with_raw_response.create(
                model=MODEL, instructions=INSTRUCTIONS, max_output_tokens=2,
                input=loop[:len(loop) - 2 * (3 - turn)])
            usage = raw.parse().usage
            assert usage is not None
            if turn:
                assert usage.input_tokens_details.cached_tokens > usage.input_tokens // 2
        async with http.get(cluster.gateway_url + "/metrics") as r:
            metrics = await r.text()
    hits = next(line for line in metrics.splitlines()
                if line.startswith("gateway_response_history_hits_total"))
    assert float(hits.split()[-1]) == 3
