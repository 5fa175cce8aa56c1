"""The worker with ``--engine torch`` (tiny random model, CPU) over real HTTP on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.contracts.httpserver import JsonErrorRunner

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (optional extra: pip install '.[torch]')"
)

from worker.server import create_app  # noqa: E402 (after importorskip)
from worker.settings import WorkerSettings  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")

MODEL = "torch-test"
REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are the referee. The rules of the game are long and detailed. " * 8


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = WorkerSettings(port=0, model=MODEL, engine="torch", model_config="tiny",
                              device="cpu", cache_blocks=256, worker_id="torch-w")
    runner = JsonErrorRunner(create_app(settings))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        torch.set_num_threads(before)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, str]]:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(), dict(resp.headers)


async def test_completion_then_repeat_reports_matched_tokens(base_url: str) -> None:
    prompt = SYSTEM + "First question?"
    async with aiohttp.ClientSession() as session:
        cold, _ = await post(session, base_url + "/v1/completions",
                             {"model": MODEL, "prompt": prompt, "max_tokens": 6})
        warm, headers = await post(session, base_url + "/v1/completions",
                                   {"model": MODEL, "prompt": prompt, "max_tokens": 6})
        async with session.get(base_url + "/metrics") as resp:
            metrics = await resp.text()
        async with session.get(base_url + "/stats") as resp:
            stats = await resp.json()
    assert cold["usage"]["matched_tokens"] == 0
    assert cold["usage"]["completion_tokens"] == 6
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]  # greedy, same prompt
    matched = warm["usage"]["matched_tokens"]
    assert matched == (warm["usage"]["prompt_tokens"] // 16) * 16 > 0
    assert headers["x-cache-matched-tokens"] == str(matched)
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples}
    assert samples["vllm:kv_cache_usage_perc"] == 0.0  # nothing running now
    assert samples["vllm:prefix_cache_hits_total"] == matched
    assert stats["engine"] == "torch"
    assert stats["engine_info"]["kv_dtype"] == "float32"
    assert stats["engine_info"]["model_params"] > 0
    assert stats["prefill_seconds"] > 0


async def test_samples_and_a_stop_sequence_on_the_real_engine(base_url: str) -> None:
    """n samples run on the real engine (greedy decoding: the same text each); a stop string
    ends the output there and releases its KV blocks."""
    prompt = SYSTEM + "Second question?"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6}
    async with aiohttp.ClientSession() as session:
        free, _ = await post(session, base_url + "/v1/completions", body)
        both, _ = await post(session, base_url + "/v1/completions", {**body, "n": 2})
        text = free["choices"][0]["text"]
        stop = text[len(text) // 2:][:2] or text[-1:]
        cut, _ = await post(session, base_url + "/v1/completions", {**body, "stop": [stop]})
        async with session.get(base_url + "/metrics") as resp:
            metrics = await resp.text()
    assert [c["text"] for c in both["choices"]] == [text, text]
    assert both["usage"]["prompt_tokens"] == free["usage"]["prompt_tokens"]
    assert both["usage"]["completion_tokens"] == 12
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples}
    assert samples["vllm:kv_cache_usage_perc"] == 0.0  # every block released


async def test_chat_system_blocks_are_tagged_and_flush_forgets(base_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as session:
        await post(session, base_url + "/v1/chat/completions", body)
        async with session.get(base_url + "/stats") as resp:
            by_priority = (await resp.json())["cache"]["cached_blocks_by_priority"]
        again, _ = await post(session, base_url + "/v1/chat/completions", body)
        async with session.post(base_url + "/admin/flush", json={"namespace": "other"}) as resp:
            assert (await resp.json())["flushed_blocks"] == 0
        async with session.post(base_url + "/admin/flush") as resp:
            flushed = await resp.json()
        after, _ = await post(session, base_url + "/v1/chat/completions", body)
    assert by_priority["system"] > 0
    assert again["usage"]["matched_tokens"] > 0
    assert flushed["flushed_blocks"] > 0
    assert after["usage"]["matched_tokens"] == 0


def test_cli_reports_a_missing_weights_package_or_file(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worker", "--engine", "torch", "--model-config", "tiny",
         "--model-weights", str(tmp_path / "missing.safetensors"), "--cache-blocks", "8"],
        capture_output=True, text=True, check=False, cwd=REPO_ROOT, timeout=120,
    )
    assert result.returncode == 2
    assert "python -m worker: error:" in result.stderr
    assert "safetensors" in result.stderr
