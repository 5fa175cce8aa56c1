"""The worker's SGLang probes and its cache-size report options, over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.contracts.httpserver import JsonErrorRunner
from worker.server import create_app
from worker.settings import WorkerSettings
from worker.tokenizer import CharsTokenizer


@asynccontextmanager
async def serve_worker(**overrides: Any) -> AsyncIterator[str]:
    settings = WorkerSettings(port=0, model="m", cache_blocks=64, block_size=4,
                              prefill_us_per_token=0, decode_ms_per_token=0, **overrides)
    runner = JsonErrorRunner(create_app(settings))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def test_sglang_probes_answer() -> None:
    async with serve_worker(max_model_len=1000) as base:
        for path in ("/server_info", "/get_server_info"):
            info = await get_json(base + path)
            assert info["model_path"] == "m"
            assert info["context_length"] == 1000
            assert info["max_total_num_tokens"] == 64 * 4
        for path in ("/model_info", "/get_model_info"):
            info = await get_json(base + path)
            assert info["model_path"] == "m"
            assert info["is_generation"] is True
        assert (await get(base + "/health_generate"))[0] == 200


def cache_info_line(metrics: str) -> str:
    return next((line for line in metrics.splitlines()
                 if line.startswith("vllm:cache_config_info{")), "")


@pytest.mark.parametrize(
    ("overrides", "blocks"),
    [({}, "64"), ({"reported_cache_blocks": 128}, "128"), ({"report_cache_size": False}, None)],
)
async def test_cache_size_report_options(overrides: dict[str, Any], blocks: str | None) -> None:
    async with serve_worker(**overrides) as base:
        status, metrics = await get(base + "/metrics")
        info = await get_json(base + "/server_info")
        stats = await get_json(base + "/stats")
    assert status == 200
    assert stats["cache"]["num_blocks"] == 64  # the real cache never changes
    line = cache_info_line(metrics)
    if blocks is None:
        assert line == ""
        assert "max_total_num_tokens" not in info
    else:
        assert f'num_gpu_blocks="{blocks}"' in line
        assert info["max_total_num_tokens"] == int(blocks) * 4


async def test_chars_tokenizer_makes_text_blocks_cache_blocks() -> None:
    """With one token per 4 characters and 4-token blocks, 16 characters are one block."""
    async with serve_worker(tokenizer="chars") as base, aiohttp.ClientSession() as session:
        prompt = "abcdefghijklmnop" * 3  # 48 chars = 12 tokens = 3 blocks
        matched = []
        for text in (prompt, prompt[:32] + "XXXXXXXXXXXXXXXX"):
            body = {"model": "m", "prompt": text, "max_tokens": 1}
            async with session.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-cache-input-tokens"] == "12"
                matched.append(int(resp.headers["x-cache-matched-blocks"]))
    assert matched == [0, 2]


def test_chars_tokenizer_is_piecewise_at_multiples_of_four() -> None:
    tok = CharsTokenizer()
    a, b = "one two three ", "and more text here"
    assert len(a) % 4 == 2
    assert len(tok.encode(a + b)) == -(-len(a + b) // 4)
    a4 = a + "xy"
    assert tok.encode(a4 + b) == tok.encode(a4) + tok.encode(b)
    assert tok.encode("") == []
