"""``python -m worker --engine vllm``: start, register, heartbeat, stop (stand-in for vLLM)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp

from gateway.store.redis import RedisStore
from infra.procs import wait_healthy
from tests.conftest import RedisServer, free_port
from worker.settings import WorkerSettings
from worker.vllm_launcher import parse_cache_info, vllm_command


def test_cache_info_is_read_from_vllm_metrics() -> None:
    text = (
        '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        'num_gpu_blocks="27153",num_cpu_blocks="0"} 1.0\n'
    )
    assert parse_cache_info(text) == (27153, 16)
    assert parse_cache_info("vllm:num_requests_running 0\n") is None


async def test_launcher_starts_registers_and_stops_vllm(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    port = free_port()
    record_file = tmp_path / "vllm.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "--engine", "vllm", "--port", str(port),
        "--model", "llama-test", "--store", redis_server.url,
        "--heartbeat-s", "0.3", "--registry-ttl-s", "1.5",
        "--vllm-binary", f"{sys.executable} -m tests.fake_vllm",
        "--", "/models/llama", "--max-model-len", "4096",
        env={**__import__("os").environ, "FAKE_VLLM_RECORD": str(record_file)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    store = RedisStore(redis_server.url)
    await store.start()
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, timeout_s=60)
        for _ in range(100):
            records = await store.list_workers()
            if records:
                break
            await asyncio.sleep(0.1)
        assert len(records) == 1
        record = records[0]
        assert record.kind == "vllm"
        assert record.url == url
        assert record.models == ("llama-test",)
        assert (record.capacity_blocks, record.block_size) == (777, 16)
        seen = json.loads(record_file.read_text())
        argv = seen["argv"]
        assert argv[:2] == ["serve", "/models/llama"]
        assert "--enable-prefix-caching" in argv
        assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
        assert "--enable-prompt-tokens-details" in argv
        assert argv[argv.index("--max-model-len") + 1] == "4096"
        assert seen["pythonhashseed"] == "0"
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json={
            "model": "llama-test", "prompt": "hello", "max_tokens": 1,
        }) as r:
            assert r.status == 200
        await asyncio.sleep(1.0)  # several heartbeats later it is still registered
        assert [r.id for r in await store.list_workers()] == [record.id]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    assert await store.list_workers() == []  # deregistered on the way out
    await store.close()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        pass
    else:
        writer.close()
        raise AssertionError("vllm (the stand-in) still listens after the launcher stopped")


def test_kv_events_become_vllms_kv_events_config() -> None:
    settings = WorkerSettings(engine="vllm", kv_events="tcp://*:5557", kv_replay="tcp://*:5558",
                              vllm_binary="vllm")
    cmd = vllm_command(settings, ["some/model"])
    config = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                      "buffer_steps": settings.kv_events_buffer}
    # The operator's own config wins; no events asked for, none configured.
    mine = vllm_command(settings, ["m", "--kv-events-config", "{}"])
    assert mine.count("--kv-events-config") == 1
    assert "--kv-events-config" not in vllm_command(WorkerSettings(engine="vllm"), ["m"])
