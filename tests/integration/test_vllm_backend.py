"""The vLLM backend end to end, with our reference worker speaking vLLM's API and metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import openai

from gateway.backends.metrics_page import parse_engine_metrics
from gateway.proxy import stats_from_usage
from gateway.session import CacheUsage
from tests.conftest import MODEL, StartCluster

PROMPT = "Summarise the maintenance manual of the tandem bicycle, chapter by chapter. " * 20


def test_engine_metrics_page_gives_load_and_cache_capacity() -> None:
    page = (
        "# HELP vllm:num_requests_running Number of requests running.\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0\n'
    )
    metrics = parse_engine_metrics(page)
    assert metrics["vllm:num_requests_running"] == 5.0
    assert metrics["cache_capacity_tokens"] == 16 * 2048
    assert metrics["engine_ranks"] == 2  # two engines behind the one server
    assert "cache_capacity_tokens" not in parse_engine_metrics(
        'vllm:cache_config_info{block_size="16"} 1.0\n'
    )
    # Samples that are not finite numbers are left out; so is a size that overflows.
    odd = parse_engine_metrics(
        'vllm:num_requests_running{engine="0"} 3.0\n'
        'vllm:num_requests_running{engine="1"} NaN\n'
        "vllm:num_requests_waiting +Inf\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e308"} 1.0\n'
    )
    assert odd == {"vllm:num_requests_running": 3.0, "engine_ranks": 2.0}
    assert parse_engine_metrics(
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="inf"} 1.0\n') == {}


def test_cache_stats_come_from_usage_in_bodies_and_streams() -> None:
    body = b'{"id": "x", "usage": {"prompt_tokens": 120, "completion_tokens": 3, ' \
           b'"prompt_tokens_details": {"cached_tokens": 96}}}'
    assert stats_from_usage(body) == CacheUsage(120, 96)
    stream = (b'data: {"choices": [{"text": "a"}]}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 50, '
              b'"prompt_tokens_details": null}}\n\ndata: [DONE]\n\n')
    assert stats_from_usage(stream) == CacheUsage(50, 0)
    assert stats_from_usage(b'{"choices": []}') is None
    # A report outside what can be: cached tokens kept within [0, prompt tokens].
    def cached(tokens: int) -> bytes:
        return (b'{"usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": '
                + str(tokens).encode() + b"}}}")

    assert stats_from_usage(cached(80)) == CacheUsage(50, 50)
    assert stats_from_usage(cached(-3)) == CacheUsage(50, 0)
    assert stats_from_usage(b'{"usage": {"prompt_tokens": -50}}') is None
    assert stats_from_usage(b"data: {not json, \"usage\"}\n\n") is None


async def test_vllm_target_chat_completions_streaming_and_tenant_salt(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1, scheme_prefix="vllm+")
    worker_url = cluster.worker_urls[0]
    async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="tenant-a",
                                  max_retries=0) as a, openai.AsyncOpenAI(
        base_url=cluster.base_url, api_key="tenant-b", max_retries=0
    ) as b:
        chat = await a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.content
        pieces = [
            c.choices[0].text async for c in await a.completions.create(
                model=MODEL, prompt="stream me", max_tokens=4, stream=True)
            if c.choices
        ]
        assert len([p for p in pieces if p]) == 4
        first = await a.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=1)
        again = await a.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=1)
        other = await b.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=1)
        # A prompt normalization leaves alone goes out as the client's bytes, the tenant's
        # salt written in front of them: isolated the same way.
        clean = PROMPT.replace("tandem", "folding").rstrip()  # a prompt no tenant sent yet
        await a.completions.create(model=MODEL, prompt=clean, max_tokens=1)
        clean_again = (await a.completions.create(model=MODEL, prompt=clean, max_tokens=1)).usage
        clean_other = (await b.completions.create(model=MODEL, prompt=clean, max_tokens=1)).usage
    assert first.headers["x-route-worker"] == worker_url.removeprefix("http://")
    usage_again = again.parse().usage
    usage_other = other.parse().usage
    assert usage_again is not None
    assert usage_other is not None
    assert usage_again.prompt_tokens_details is not None
    assert (usage_again.prompt_tokens_details.cached_tokens or 0) > 0  # same tenant: reused
    # Another tenant: its cache_salt differs, so it shares no KV block with tenant A.
    assert usage_other.prompt_tokens_details is not None
    assert usage_other.prompt_tokens_details.cached_tokens == 0
    assert clean_again is not None
    assert clean_again.prompt_tokens_details is not None
    assert (clean_again.prompt_tokens_details.cached_tokens or 0) > 0
    assert clean_other is not None
    assert clean_other.prompt_tokens_details is not None
    assert clean_other.prompt_tokens_details.cached_tokens == 0
    async with aiohttp.ClientSession() as http, http.get(
        cluster.gateway_url + "/admin/workers"
    ) as r:
        view = (await r.json())["workers"][0]
    assert view["kind"] == "vllm"
    assert "vllm:num_requests_running" in view["engine_metrics"]
    # The KV cache size from vllm:cache_config_info sizes the index's model of the worker.
    assert view["engine_metrics"]["cache_capacity_tokens"] > 0
    assert view["capacity_blocks"] > 0
    assert 0 < view["modelled_blocks"] <= view["capacity_blocks"]
    assert view["input_tokens"] > 0


async def test_the_gateway_learns_how_quickly_each_engine_starts_its_requests(
    start_cluster: StartCluster,
) -> None:
    """The reference worker's ``vllm:time_to_first_token_seconds`` histogram, scraped by the
    health probes, becomes the worker's mean time to first token in ``/admin/workers``: the
    mean of the requests it started between two scrapes."""
    cluster = await start_cluster(workers=1, health_interval_s=0.1, warmup=False)
    async with aiohttp.ClientSession() as http:
        async def view() -> dict[str, object]:
            async with http.get(cluster.gateway_url + "/admin/workers") as r:
                worker: dict[str, object] = (await r.json())["workers"][0]
                return worker

        before = await view()
        assert before["first_token_s"] is None  # it started nothing yet
        async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k") as oa:
            for i in range(3):
                await oa.completions.create(model=MODEL, prompt=f"{i} {PROMPT}", max_tokens=2)
        for _ in range(100):
            after = await view()
            metrics = after["engine_metrics"]
            assert isinstance(metrics, dict)
            if metrics.get("vllm:time_to_first_token_seconds_count", 0) >= 3:
                break
            await asyncio.sleep(0.05)
        first_token_s = after["first_token_s"]
        assert isinstance(first_token_s, float)
        assert isinstance(metrics, dict)
        total = metrics["vllm:time_to_first_token_seconds_sum"]
        assert 0.0 < first_token_s <= total  # the mean of what it started since a scrape
        async with http.get(cluster.gateway_url + "/metrics") as r:
            page = await r.text()
        wid = cluster.worker_urls[0].removeprefix("http://")
        gauge = f'gateway_worker_engine_first_token_seconds{{worker="{wid}"}} '
        assert any(line.startswith(gauge) and float(line.split()[-1]) > 0.0
                   for line in page.splitlines()), page[:2000]
