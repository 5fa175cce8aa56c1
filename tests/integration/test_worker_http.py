"""The worker over real HTTP on 127.0.0.1: the official openai client, raw aiohttp for errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.contracts.config import SettingsError
from gateway.contracts.httpserver import JsonErrorRunner
from worker.server import ENGINE_KEY, create_app
from worker.settings import WorkerSettings, parse_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "test-model"
PREFIX = ("The shared system prompt explains the rules of the game in detail. " * 30)[:2000]


@dataclass
class Worker:
    base_url: str
    app: web.Application
    clients: list[AsyncOpenAI] = field(default_factory=list)

    def client(self) -> AsyncOpenAI:
        client = AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0)
        self.clients.append(client)
        return client


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    settings = WorkerSettings(
        port=0,
        model=MODEL,
        cache_blocks=512,
        block_size=16,
        max_running=4,
        prefill_us_per_token=0.1,
        prefill_us_per_cached_token=0.0,
        decode_ms_per_token=0.01,
        max_model_len=4096,
        worker_id="w-test",
    )
    app = create_app(settings)
    runner = JsonErrorRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    handle = Worker(f"http://127.0.0.1:{port}", app)
    try:
        yield handle
    finally:
        for client in handle.clients:
            await client.close()
        await runner.cleanup()


def extra(usage: Any) -> dict[str, Any]:
    """The usage extension fields as the openai client exposes them."""
    data: dict[str, Any] = usage.model_dump()
    return data


async def test_completion_reports_cache_stats_in_usage_and_headers(worker: Worker) -> None:
    client = worker.client()
    cold = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PREFIX + " First question?", max_tokens=5
    )
    warm = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PREFIX + " A different question!", max_tokens=5
    )
    cold_body, warm_body = cold.parse(), warm.parse()
    assert cold_body.object == "text_completion"
    assert cold_body.model == MODEL
    assert cold_body.choices[0].finish_reason == "length"
    assert cold_body.choices[0].text.strip()
    assert cold_body.usage is not None
    assert warm_body.usage is not None
    assert cold_body.usage.completion_tokens == 5
    cold_usage, warm_usage = extra(cold_body.usage), extra(warm_body.usage)
    assert cold_usage["matched_tokens"] == 0
    assert cold_usage["cache_hit_ratio"] == 0.0
    assert cold.headers["x-cache-matched-tokens"] == "0"
    assert cold.headers["x-worker-id"] == "w-test"

    matched = warm_usage["matched_tokens"]
    assert matched > 0
    assert matched % 16 == 0
    assert warm_usage["matched_blocks"] == matched // 16
    assert warm_usage["input_tokens"] == warm_body.usage.prompt_tokens
    assert warm_usage["prompt_tokens_details"]["cached_tokens"] == matched
    assert warm_usage["cache_hit_ratio"] == pytest.approx(matched / warm_usage["input_tokens"])
    assert warm.headers["x-cache-matched-tokens"] == str(matched)
    assert warm.headers["x-cache-matched-blocks"] == str(matched // 16)
    assert warm.headers["x-cache-input-tokens"] == str(warm_usage["input_tokens"])
    assert float(warm.headers["x-cache-hit-ratio"]) == pytest.approx(
        warm_usage["cache_hit_ratio"], abs=1e-6
    )
    # When the engine freed the request's blocks, on the host's monotonic clock: after the
    # first request's, before this reply was read.
    assert (float(cold.headers["x-engine-done-at"]) < float(warm.headers["x-engine-done-at"])
            <= time.monotonic())
    # ... and when it had computed the prompt (its first token), before it freed them.
    assert (float(cold.headers["x-engine-done-at"])
            < float(warm.headers["x-engine-computed-at"])
            <= float(warm.headers["x-engine-done-at"]))


async def test_cache_salt_and_namespace_header_isolate(worker: Worker) -> None:
    client = worker.client()
    await client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=1)
    salted = await client.completions.create(
        model=MODEL, prompt=PREFIX, max_tokens=1, extra_body={"cache_salt": "tenant-b"}
    )
    assert salted.usage is not None
    assert extra(salted.usage)["matched_tokens"] == 0
    other_ns = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PREFIX, max_tokens=1, extra_headers={"x-cache-namespace": "ns-c"}
    )
    assert other_ns.headers["x-cache-matched-tokens"] == "0"
    same = await client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=1)
    assert same.usage is not None
    assert extra(same.usage)["matched_tokens"] > 0


async def test_multiple_prompts_and_token_ids(worker: Worker) -> None:
    client = worker.client()
    many = await client.completions.create(model=MODEL, prompt=["one two", "three"], max_tokens=2)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage is not None
    assert many.usage.completion_tokens == 4
    ids = await client.completions.create(model=MODEL, prompt=list(range(40)), max_tokens=2)
    assert ids.usage is not None
    assert ids.usage.prompt_tokens == 40
    again = await client.completions.create(
        model=MODEL, prompt=[list(range(40)), list(range(40))], max_tokens=2
    )
    assert again.usage is not None
    assert again.usage.prompt_tokens == 80
    assert extra(again.usage)["matched_tokens"] == 64  # 2 full blocks, for each prompt


async def test_chat_completion_reuses_previous_turn(worker: Worker) -> None:
    client = worker.client()
    first = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": "Hi"}],
        max_tokens=4,
    )
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    answer = first.choices[0].message.content
    assert answer
    second = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": PREFIX},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
        ],
        max_tokens=4,
    )
    assert first.usage is not None
    assert second.usage is not None
    assert extra(second.usage)["matched_tokens"] >= (first.usage.prompt_tokens // 16) * 16 - 16


async def test_streaming_chat_with_usage(worker: Worker) -> None:
    client = worker.client()
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PREFIX}], max_tokens=1
    )
    async with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PREFIX}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        header_matched = int(raw.headers["x-cache-matched-tokens"])
        stream = await raw.parse()
        chunks = [chunk async for chunk in stream]
    assert header_matched > 0
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    content = [piece for piece in content if piece]
    assert len(content) == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert final.usage.completion_tokens == 6
    assert extra(final.usage)["matched_tokens"] == header_matched


async def test_streaming_completion(worker: Worker) -> None:
    client = worker.client()
    stream = await client.completions.create(
        model=MODEL, prompt="Tell me a story", max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) == 3
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


async def test_models_health_stats(worker: Worker) -> None:
    models = await worker.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as session:
        async with session.get(worker.base_url + "/health") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ok"}
        async with session.get(worker.base_url + "/stats") as resp:
            stats = await resp.json()
    assert stats["worker_id"] == "w-test"
    assert stats["cache"]["num_blocks"] == 512
    assert stats["running"] == 0
    assert stats["engine_info"]["cache_reuse"] == "scheduled"  # vLLM's rule, the default


async def test_metrics_use_vllm_names_and_count_tokens(worker: Worker) -> None:
    client = worker.client()
    usages = []
    for suffix in (" one", " two"):
        completion = await client.completions.create(
            model=MODEL, prompt=PREFIX + suffix, max_tokens=2
        )
        assert completion.usage is not None
        usages.append(extra(completion.usage))
    async with aiohttp.ClientSession() as session, session.get(
        worker.base_url + "/metrics"
    ) as resp:
        assert resp.status == 200
        text = await resp.text()
    samples = {
        s.name: s for family in text_string_to_metric_families(text) for s in family.samples
    }
    queries = samples["vllm:prefix_cache_queries_total"]
    hits = samples["vllm:prefix_cache_hits_total"]
    assert queries.labels == {"model_name": MODEL}
    assert queries.value == sum(u["input_tokens"] for u in usages)
    assert hits.value == sum(u["matched_tokens"] for u in usages) > 0
    assert samples["vllm:num_requests_running"].value == 0
    assert samples["vllm:num_requests_waiting"].value == 0
    assert 0.0 <= samples["vllm:kv_cache_usage_perc"].value <= 1.0
    assert samples["vllm:time_to_first_token_seconds_count"].value == 2
    engine = worker.app[ENGINE_KEY]
    assert engine.stats().cache.hit_tokens == hits.value


LONG = "word " * 5000  # ~5,000 tokens > max_model_len 4096


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v1/completions", b"{not json", 400, "invalid_json", None),
        ("/v1/completions", b"[1, 2]", 400, "invalid_json", None),
        ("/v1/completions", {"prompt": "x"}, 400, "missing_required_parameter", "model"),
        ("/v1/completions", {"model": 3, "prompt": "x"}, 400, "invalid_type", "model"),
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model_not_found", "model"),
        ("/v1/completions", {"model": MODEL}, 400, "missing_required_parameter", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "invalid_type", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "invalid_value", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", 1]}, 400, "invalid_type", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "invalid_type", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1], ["a"]]}, 400, "invalid_type",
         "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400,
         "invalid_value", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400,
         "invalid_type", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400,
         "invalid_type", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400,
         "invalid_type", "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 129}, 400,
         "invalid_value", "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": 5}, 400,
         "invalid_type", "cache_salt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": []}, 400,
         "invalid_type", "stream_options"),
        ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400,
         "context_length_exceeded", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400,
         "context_length_exceeded", "prompt"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "missing_required_parameter",
         "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_value",
         "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "invalid_type",
         "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard",
         "content": "x"}]}, 400, "invalid_value", "messages[0].role"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
         "content": 5}]}, 400, "invalid_value", "messages[0].content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
         "content": [{"type": "image_url"}]}]}, 400, "invalid_value", "messages[0].content[0]"),
        ("/v1/chat/completions", {"model": MODEL, "messages": ["x"]}, 400, "invalid_value",
         "messages[0]"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
         "content": "x"}], "tools": {}}, 400, "invalid_type", "tools"),
        ("/v1/chat/completions", {"model": "other", "messages": []}, 404, "model_not_found",
         "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
         "content": LONG}]}, 400, "context_length_exceeded", "messages"),
    ],
)
async def test_bad_input_gets_openai_error(
    worker: Worker, path: str, body: Any, status: int, code: str, param: str | None
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.post(
        worker.base_url + path, data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == status
        payload = await resp.json()
    error = payload["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert error["param"] == param
    assert isinstance(error["message"], str)
    assert error["message"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nope", 404), ("GET", "/v1/completions", 405), ("POST", "/health", 405)],
)
async def test_unknown_routes_get_openai_error(
    worker: Worker, method: str, path: str, status: int
) -> None:
    async with aiohttp.ClientSession() as session, session.request(
        method, worker.base_url + path
    ) as resp:
        assert resp.status == status
        payload = await resp.json()
    assert payload["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("tool_choice", ["none", "auto", None])
async def test_tools_and_names_render_without_error(
    worker: Worker, tool_choice: str | None
) -> None:
    # The tools are context (rendered into the prompt, cached with it) whether the client
    # leaves the choice to the model or forbids calls: the simulated model answers in text.
    client = worker.client()
    messages: list[Any] = [
        {"role": "user", "content": "weather?", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    choice: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
    without = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    resp = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2,
        tools=[{"type": "function", "function": {"name": "weather", "parameters": {}}}],
        **choice,
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.tool_calls is None
    assert resp.usage is not None
    assert without.usage is not None
    assert resp.usage.prompt_tokens > without.usage.prompt_tokens  # the tools are in the prompt


_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
_HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"tools": _TOOLS, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": _TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "weather"}}}, "tool_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}},
         "response_format"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"logprobs": 3}, "logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ],
)
async def test_unimplemented_parameters_are_refused(
    worker: Worker, path: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, **extra}
    body["messages" if "chat" in path else "prompt"] = _HI if "chat" in path else "hi"
    async with aiohttp.ClientSession() as session, session.post(
        worker.base_url + path, json=body
    ) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["code"] in ("unsupported_parameter", "unsupported_value")


async def test_n_samples_share_the_prompt_and_count_it_once(worker: Worker) -> None:
    client = worker.client()
    messages: list[Any] = [{"role": "system", "content": "You answer briefly. " * 20},
                           {"role": "user", "content": "Name three colours."}]
    one = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    again = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    three = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert texts[0] == one.choices[0].message.content  # the first sample is the n=1 answer
    assert len(set(texts)) == 3  # each sample its own words
    assert one.usage is not None
    assert again.usage is not None
    assert three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
              for u in (again.usage, three.usage)]
    assert cached[0]  # the repeated prompt was found cached ...
    assert cached[1] == cached[0]  # ... and n samples report it once


async def test_n_samples_stream_each_choice(worker: Worker) -> None:
    client = worker.client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=4, n=2,
        stream=True, stream_options={"include_usage": True})
    roles: list[int] = []
    pieces: dict[int, list[str]] = {0: [], 1: []}
    finished: list[int] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.append(choice.index)
            elif choice.delta.content:
                pieces[choice.index].append(choice.delta.content)
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert sorted(roles) == [0, 1]
    assert sorted(finished) == [0, 1]
    assert all(len(p) == 4 for p in pieces.values())
    assert usage is not None
    assert usage.completion_tokens == 8


async def test_n_samples_of_a_batch_of_prompts_in_order(worker: Worker) -> None:
    prompts = ["first prompt of the batch", "second prompt"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "n": 2}
    alone: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            single = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
            async with session.post(worker.base_url + "/v1/completions", json=single) as resp:
                alone.append(await resp.json())
        async with session.post(worker.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            both = await resp.json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    # Choice p * n + j is sample j of prompt p: 0 and 2 are the prompts' first samples.
    assert both["choices"][0]["text"] == alone[0]["choices"][0]["text"]
    assert both["choices"][2]["text"] == alone[1]["choices"][0]["text"]
    assert both["choices"][1]["text"] != both["choices"][0]["text"]
    assert both["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert both["usage"]["completion_tokens"] == 4 * 3


async def test_stop_sequences_cut_the_output_and_stop_generating(worker: Worker) -> None:
    client = worker.client()
    messages: list[Any] = [{"role": "user", "content": "Tell me a long story."}]
    free = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    text = free.choices[0].message.content
    assert text is not None
    words = text.split(" ")[1:]  # each piece is " word"
    # A stop string that spans the end of the third word and the start of the fourth.
    stop = words[2][-1] + " " + words[3][:1]
    cut = text.index(stop)
    # Tokens generated until the stop string was complete (one " word" piece a token).
    ends = [len(" ".join(["", *words[:k + 1]])) for k in range(len(words))]
    generated = next(k + 1 for k, end in enumerate(ends) if end >= cut + len(stop))
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 stop=[stop, "never there"])
    assert whole.choices[0].message.content == text[:cut]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == generated  # the engine generated no more
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stop=stop, stream=True,
        stream_options={"include_usage": True})
    pieces: list[str] = []
    finish = None
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text[:cut]
    assert finish == "stop"
    assert usage is not None
    assert usage.completion_tokens == generated < 8
    # No stop string in the output: as without one, to the end of max_tokens.
    other = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 stop="never there")
    assert other.choices[0].message.content == text
    assert other.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stop", [3, ["a", 1], ["s"] * 17])
async def test_bad_stop_sequences_are_refused(worker: Worker, stop: Any) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": stop}
    async with aiohttp.ClientSession() as session, session.post(
        worker.base_url + "/v1/completions", json=body
    ) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == "stop"
    assert error["code"] == "invalid_type"


async def test_parameters_sent_with_their_defaults_are_served(worker: Worker) -> None:
    body = {"model": MODEL, "messages": _HI, "max_tokens": 1, "n": 1, "logprobs": False,
            "response_format": {"type": "text"}, "tools": [], "stop": None, "echo": False,
            "logit_bias": {}, "tool_choice": "none"}
    async with aiohttp.ClientSession() as session, session.post(
        worker.base_url + "/v1/chat/completions", json=body
    ) as resp:
        assert resp.status == 200


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": ""},
        {"model": MODEL, "prompt": [[]]},
        {"model": MODEL, "prompt": "lone \ud800 surrogate", "cache_salt": "\udfff"},
        {"model": MODEL, "prompt": "x", "max_tokens": None, "stream": None, "n": 1},
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
        {"model": MODEL, "prompt": "x", "temperature": 0.5, "unknown_field": {"a": 1}},
    ],
)
async def test_odd_but_valid_input_is_served(worker: Worker, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as session, session.post(
        worker.base_url + "/v1/completions", data=json.dumps(body)
    ) as resp:
        assert resp.status == 200
        payload = await resp.json()
    assert payload["usage"]["completion_tokens"] == 16  # the default max_tokens


async def test_deeply_nested_json_is_a_client_error(worker: Worker) -> None:
    async with aiohttp.ClientSession() as session, session.post(
        worker.base_url + "/v1/completions", data=b"[" * 100_000
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_json"


async def test_client_disconnect_mid_stream_releases_blocks() -> None:
    settings = WorkerSettings(port=0, model=MODEL, decode_ms_per_token=20.0, worker_id="slow")
    runner = JsonErrorRunner(create_app(settings))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    engine = runner.app[ENGINE_KEY]
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": PREFIX, "max_tokens": 1000, "stream": True}
            async with session.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # first event arrived: the request is running
                assert engine.stats().running == 1
            # Leaving the block closed the connection mid-stream.
        for _ in range(500):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().running == 0
        assert engine.stats().cache.referenced_blocks == 0
        assert engine.stats().generation_tokens < 1000
    finally:
        await runner.cleanup()


def test_cli_help_and_bad_engine() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "worker", "--help"],
        capture_output=True, text=True, check=False, cwd=REPO_ROOT,
    )
    assert ok.returncode == 0
    assert "--cache-blocks" in ok.stdout
    assert "WORKER_MAX_RUNNING" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "worker", "--engine", "tgi"],
        capture_output=True, text=True, check=False, cwd=REPO_ROOT,
    )
    assert bad.returncode == 2
    assert "engine 'tgi' is not available" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "worker", "--engine", "vllm", "--vllm-binary", "no-such-vllm"],
        capture_output=True, text=True, check=False, cwd=REPO_ROOT,
    )
    assert missing.returncode == 2
    assert "cannot start vllm" in missing.stderr


def test_settings_from_environment() -> None:
    settings = parse_settings([], {"WORKER_MAX_RUNNING": "3", "WORKER_PORT": "9000"})
    assert (settings.max_running, settings.port) == (3, 9000)
    assert settings.effective_worker_id == "127.0.0.1:9000"
    with pytest.raises(SettingsError, match="block_size"):
        WorkerSettings(block_size=0)


async def test_priority_needs_priority_scheduling_as_vllm_does(worker: Worker) -> None:
    """vLLM's ``priority``: 0 is every request's default; any other value is refused by an
    engine on first-come-first-served scheduling (the default), and taken with
    ``--scheduling-policy priority``."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        for extra_fields, status in (({"priority": 0}, 200), ({"priority": 3}, 400),
                                     ({"priority": "3"}, 400), ({"priority": True}, 400)):
            async with session.post(f"{worker.base_url}/v1/completions",
                                    json={**body, **extra_fields}) as resp:
                assert resp.status == status, extra_fields
                if status == 400:
                    error = (await resp.json())["error"]
                    assert error["param"] == "priority"
                    assert error["type"] == "invalid_request_error"
    settings = WorkerSettings(port=0, model=MODEL, cache_blocks=64, block_size=16,
                              prefill_us_per_token=0.0, decode_ms_per_token=0.0,
                              scheduling_policy="priority")
    runner = JsonErrorRunner(create_app(settings))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        async with aiohttp.ClientSession() as session:
            for value in (3, -2):
                async with session.post(url, json={**body, "priority": value}) as resp:
                    assert resp.status == 200, await resp.text()
    finally:
        await runner.cleanup()
    with pytest.raises(SettingsError, match="scheduling_policy"):
        WorkerSettings(scheduling_policy="lifo")


async def test_a_prompt_being_computed_is_reused_and_its_reuser_answers_after_it() -> None:
    """vLLM's rule (``--cache-reuse scheduled``, the default): B, sent while A is computing
    the same 2,000-character prefix, reuses A's blocks and has its first token only once A
    computed them; with ``--cache-reuse computed`` it computes them again."""
    for rule in ("scheduled", "computed"):
        settings = WorkerSettings(
            port=0, model=MODEL, cache_blocks=512, block_size=16, max_running=4,
            prefill_us_per_token=400.0, prefill_us_per_cached_token=0.0,
            decode_ms_per_token=0.01, max_model_len=4096, prefill_shared=True,
            cache_reuse=rule)
        runner = JsonErrorRunner(create_app(settings))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        try:
            async with aiohttp.ClientSession() as http:
                (a_matched, a_computed), (b_matched, b_computed) = await asyncio.gather(
                    _computed_at(http, url, PREFIX, 0.0),
                    _computed_at(http, url, PREFIX + " And one more question.", 0.05))
        finally:
            await runner.cleanup()
        assert a_matched == 0
        if rule == "scheduled":
            assert b_matched >= 16 * 10  # A's full blocks of the prefix
            assert b_computed >= a_computed
        else:
            assert b_matched == 0, rule


async def _computed_at(http: aiohttp.ClientSession, url: str, prompt: str,
                       after_s: float) -> tuple[int, float]:
    """After ``after_s``, a completion of ``prompt``: the tokens its worker reused, and when
    its engine had computed the prompt."""
    await asyncio.sleep(after_s)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(url, json=body) as reply:
        assert reply.status == 200, await reply.text()
        return (int(reply.headers["x-cache-matched-tokens"]),
                float(reply.headers["x-engine-computed-at"]))
