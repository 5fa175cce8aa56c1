"""The engine's API besides completions, through the gateway: embeddings with the official
``openai`` client, vLLM's tokenizer endpoints, keys and tenants, errors, failover; reference
workers behind it (and, for what a vLLM worker is sent, a stand-in for vLLM's wire)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.conftest import FAST_WORKER, MODEL, StartCluster, engine_stub, free_port, serve

KEYS = ("sk-acme-1:acme", "sk-globex-1:globex")
TEXTS = ["the tandem bicycle has two saddles", "a tandem bicycle seats two riders",
         "quarterly revenue grew by four percent"]


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b))


async def _post(url: str, body: Any, key: str = "", raw: bytes | None = None
                ) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with http.post(url, headers=headers, **kwargs) as r:
            payload = await r.json(content_type=None)
            return r.status, dict(r.headers), payload


async def test_embeddings_through_the_gateway_with_the_openai_client(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2, api_key=KEYS)
    async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="sk-acme-1",
                                  max_retries=0) as client:
        # The client asks for base64 by default and decodes it.
        result = await client.embeddings.create(model=MODEL, input=TEXTS)
        small = await client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64,
                                               encoding_format="float")
    vectors = [d.embedding for d in result.data]
    assert [d.index for d in result.data] == [0, 1, 2]
    assert result.model == MODEL
    assert result.usage.prompt_tokens > 0
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-5 for v in vectors)
    # Texts that share words point closer together than unrelated ones.
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2])
    assert len(small.data[0].embedding) == 64
    # What the gateway relays is what the worker computes.
    status, _, direct = await _post(cluster.worker_urls[0] + "/v1/embeddings",
                                    {"model": MODEL, "input": TEXTS[0], "dimensions": 64})
    assert status == 200
    assert direct["data"][0]["embedding"] == pytest.approx(small.data[0].embedding, abs=1e-6)


async def test_every_engine_path_needs_a_key_once_keys_are_configured(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS, route_headers="admin")
    url = cluster.gateway_url
    for path, body in (("/v1/embeddings", {"model": MODEL, "input": "hi"}),
                       ("/tokenize", {"model": MODEL, "prompt": "hi"}),
                       ("/detokenize", {"model": MODEL, "tokens": [1, 2]}),
                       ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]})):
        status, headers, payload = await _post(url + path, body)
        assert status == 401, path
        assert payload["error"]["code"] == "invalid_api_key"
        status, headers, payload = await _post(url + path, body, key="sk-wrong")
        assert status == 401, path
    status, headers, payload = await _post(url + "/tokenize", {"model": MODEL, "prompt": "hi"},
                                           key="sk-acme-1")
    assert status == 200
    assert payload["count"] == len(payload["tokens"]) > 0
    # Routing headers are for the callers allowed to see them (here: admins only).
    assert not any(h.lower().startswith("x-route-") for h in headers)


async def test_tokenizer_endpoints_relay_the_workers_answer(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2)
    body = {"model": MODEL, "prompt": "Summarise the manual, chapter by chapter."}
    status, headers, relayed = await _post(cluster.gateway_url + "/tokenize", body)
    assert status == 200
    assert headers["x-route-worker"] in {u.removeprefix("http://") for u in cluster.worker_urls}
    _, _, direct = await _post(cluster.worker_urls[0] + "/tokenize", body)
    assert relayed == direct
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    status, _, counted = await _post(cluster.gateway_url + "/tokenize", chat)
    assert status == 200
    assert counted["count"] > 0
    status, _, text = await _post(cluster.gateway_url + "/detokenize",
                                  {"model": MODEL, "tokens": relayed["tokens"][:3]})
    assert status == 200
    assert isinstance(text["prompt"], str)
    assert text["prompt"]
    # With one model served, ``model`` may be left out, as the engines take it.
    status, _, again = await _post(cluster.gateway_url + "/tokenize",
                                   {"prompt": body["prompt"]})
    assert status == 200
    assert again["tokens"] == relayed["tokens"]


async def test_requests_spread_over_the_workers_and_skip_a_dead_one(
        start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2, dead_workers=1)
    seen: set[str] = set()
    for i in range(12):
        status, headers, payload = await _post(cluster.gateway_url + "/v1/embeddings",
                                               {"model": MODEL, "input": f"question {i}"})
        assert status == 200, payload
        seen.add(headers["x-route-worker"])
    assert seen == {u.removeprefix("http://") for u in cluster.worker_urls[:2]}


async def test_bad_input_gets_an_openai_error(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, max_body_bytes=4096)
    url = cluster.gateway_url + "/v1/embeddings"
    cases: list[tuple[dict[str, Any] | None, bytes | None, int, str | None]] = [
        (None, b"{not json", 400, None),
        (None, b"[1, 2]", 400, None),
        ({"model": "no-such-model", "input": "hi"}, None, 404, "model"),
        ({"model": 7, "input": "hi"}, None, 400, "model"),
        ({"model": MODEL, "input": "hi", "cache_salt": 3}, None, 400, "cache_salt"),
        ({"model": MODEL, "input": {"text": "hi"}}, None, 400, "input"),  # the worker's 400
        ({"model": MODEL, "input": ""}, None, 400, "input"),
        ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, None, 400,
         "encoding_format"),
        ({"model": MODEL, "input": "x" * 5000}, None, 413, None),
    ]
    for body, raw, expected, param in cases:
        status, _, payload = await _post(url, body, raw=raw)
        assert status == expected, (body, raw, payload)
        assert set(payload["error"]) >= {"message", "type", "code"}, payload
        if param is not None:
            assert payload["error"]["param"] == param, payload


class VLLMPooling:
    """Stands in for a vLLM worker's pooling and tokenizer endpoints: records what it got."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[dict[str, Any]]] = {}

    def app(self) -> web.Application:
        app = engine_stub()

        async def record(request: web.Request) -> web.Response:
            self.bodies.setdefault(request.path, []).append(await request.json())
            return web.json_response({"object": "list", "data": [], "model": MODEL})

        for path in ("/v1/embeddings", "/tokenize", "/v1/rerank"):
            app.router.add_post(path, record)
        return app


async def test_a_vllm_worker_gets_the_tenants_namespace_on_pooling_requests(
        start_cluster: StartCluster) -> None:
    upstream = VLLMPooling()
    port = free_port()
    runner = await serve(upstream.app(), port)
    try:
        cluster = await start_cluster(workers=0, worker=(f"vllm+http://127.0.0.1:{port}",),
                                      api_key=KEYS)
        for key in ("sk-acme-1", "sk-globex-1"):
            for salt in (None, "mine"):
                body = {"model": MODEL, "input": "hi"} | ({"cache_salt": salt} if salt else {})
                status, _, _ = await _post(cluster.gateway_url + "/v1/embeddings", body, key=key)
                assert status == 200
        status, _, _ = await _post(cluster.gateway_url + "/tokenize",
                                   {"model": MODEL, "prompt": "hi"}, key="sk-acme-1")
        assert status == 200
    finally:
        await runner.cleanup()
    salts = [b.get("cache_salt") for b in upstream.bodies["/v1/embeddings"]]
    # Every request is salted, each tenant (and each salt of a tenant) apart, and a client's
    # salt never reaches the engine as it was sent.
    assert all(isinstance(s, str) and s for s in salts)
    assert len(set(salts)) == 4
    assert "mine" not in salts
    assert upstream.bodies["/tokenize"] == [{"model": MODEL, "prompt": "hi"}]


async def test_a_worker_kept_away_by_its_breaker_is_a_503_not_a_404(
        start_cluster: StartCluster) -> None:
    """The model's only worker fails (500) until its breaker opens; while it stays open the
    requests for that model find no worker now (503, retry), not a path that is not served."""
    failing = engine_stub()

    async def broken(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    failing.router.add_post("/v1/embeddings", broken)
    port = free_port()
    runner = await serve(failing, port)
    try:
        # Another worker, of another model, keeps the pool healthy when the breaker opens.
        other = dataclasses.replace(FAST_WORKER, model="other-model")
        cluster = await start_cluster(workers=1, worker_settings=other,
                                      breaker_failures=2, breaker_cooldown_s=60)
        async with aiohttp.ClientSession() as http, http.get(
                cluster.gateway_url + "/v1/models") as r:
            assert {m["id"] for m in (await r.json())["data"]} == {"other-model"}
        cluster2 = await start_cluster(
            workers=0, worker=(f"http://127.0.0.1:{port}", cluster.worker_urls[0]),
            breaker_failures=2, breaker_cooldown_s=60)
        statuses = []
        for _ in range(4):
            status, _, payload = await _post(cluster2.gateway_url + "/v1/embeddings",
                                             {"model": MODEL, "input": "hi"})
            statuses.append((status, payload["error"]["code"]))
    finally:
        await runner.cleanup()
    assert statuses[0] == (502, "worker_failed")
    assert statuses[-1] == (503, "no_healthy_worker")
