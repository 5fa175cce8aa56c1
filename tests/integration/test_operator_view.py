"""The operator's view end to end: request ids, access log lines, metrics, miss diagnosis,
``/admin/explain`` and ``GET /v1/models/{id}`` (real gateway and workers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import aiohttp
import openai
import pytest

from gateway.contracts.engine_owners import REFERENCE_OWNER
from tests.conftest import FAST_WORKER, MODEL, StartCluster, serve
from worker.server import create_app as create_worker

SECRET = "the launch code is PURPLE-ELEPHANT-42"
PREFIX = (
    "You answer questions about the railway timetable. Be exact about platforms and times, "
    "and say so when a connection is not guaranteed. "
) * 12  # about 1,700 characters: many fingerprint blocks


def client(base_url: str, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, key: str = "key-a",
                   **extra: object) -> aiohttp.ClientResponse:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    async with http.post(url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r


async def misses(http: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with http.get(url + "/admin/misses") as r:
        assert r.status == 200
        payload: dict[str, object] = await r.json()
        return payload


async def test_request_id_is_echoed_generated_and_on_errors(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    async with aiohttp.ClientSession() as http:
        r = await complete(http, cluster.gateway_url, "hello")
        generated = r.headers["x-request-id"]
        assert len(generated) == 32
        async with http.post(cluster.gateway_url + "/v1/completions",
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                             headers={"x-request-id": "client-req-17"}) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == "client-req-17"
        async with http.post(cluster.gateway_url + "/v1/completions",
                             json={"model": "nope", "prompt": "hi"},
                             headers={"x-request-id": "bad id with spaces"}) as r:
            assert r.status == 404
            rid = r.headers["x-request-id"]
            assert rid != "bad id with spaces"
            assert len(rid) == 32
    assert generated != rid


async def test_access_log_has_one_json_line_per_request_and_no_prompt_text(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    cluster = await start_cluster(workers=2)
    async with aiohttp.ClientSession() as http:
        await complete(http, cluster.gateway_url, PREFIX + SECRET)
        async with http.post(cluster.gateway_url + "/v1/chat/completions",
                             json={"model": MODEL, "stream": True, "max_tokens": 3,
                                   "messages": [{"role": "user", "content": SECRET}]},
                             headers={"x-request-id": "stream-1"}) as r:
            await r.read()
        async with http.post(cluster.gateway_url + "/v1/completions",
                             json={"model": MODEL, "prompt": SECRET, "max_tokens": "x"},
                             headers={"x-request-id": "bad-1"}) as r:
            assert r.status == 400
        async with http.get(cluster.gateway_url + "/health") as r:
            assert r.status == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "gateway.access"]
    assert len(lines) == 3, lines  # the health check is not logged
    assert all(SECRET not in line and "PURPLE" not in line for line in lines)
    first, stream, bad = (json.loads(line) for line in lines)
    assert first["status"] == 200
    assert first["path"] == "/v1/completions"
    assert first["decision"] == "cold"
    assert first["policy"] == "cache_aware"
    assert first["worker"].startswith("127.0.0.1:")
    assert first["input_tokens"] > 0
    assert first["cached_tokens"] == 0
    assert first["attempts"] == 1
    assert first["bytes"] > 0
    assert first["latency_ms"] > 0
    assert len(first["tenant"]) == 16
    assert first["model"] == MODEL
    assert stream["request_id"] == "stream-1"
    assert stream["stream"] is True
    assert 0 < stream["ttft_ms"] <= stream["latency_ms"]
    assert bad["request_id"] == "bad-1"
    assert bad["status"] == 400
    assert bad["error"] == "invalid_type"
    assert not any(SECRET in rec.getMessage() for rec in caplog.records)


async def test_metrics_latency_errors_build_and_store(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2)
    async with client(cluster.base_url) as oa:
        await oa.completions.create(model=MODEL, prompt=PREFIX, max_tokens=2)
        stream = await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await oa.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    async with aiohttp.ClientSession() as http, http.get(cluster.gateway_url + "/metrics") as r:
        text = await r.text()
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in text.splitlines() if line and not line.startswith("#")}

    def total(prefix: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(prefix))

    assert total('gateway_request_duration_seconds_count{policy="cache_aware",worker="127') == 2
    assert total("gateway_time_to_first_token_seconds_count{") == 1
    assert total('gateway_upstream_duration_seconds_count{policy="cache_aware"') == 2
    assert samples['gateway_errors_total{code="model_not_found",status="404"}'] == 1
    assert samples["gateway_store_up"] == 1
    assert samples["gateway_store_unreadable_entries_total"] == 0
    assert any(k.startswith("gateway_build_info{") for k in samples)
    assert total("gateway_predicted_cached_tokens_total{") == 0  # both were cold


async def test_metrics_show_a_busy_event_loop_and_the_process_cpu(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1)
    async with client(cluster.base_url) as oa:
        await oa.completions.create(model=MODEL, prompt=PREFIX, max_tokens=2)
    # The gateway runs on this test's event loop: holding the loop for 0.6 s holds its lag
    # timer (sampled every 0.25 s) at least 0.35 s past the time it was due.
    time.sleep(0.6)  # noqa: ASYNC251 (the loop held, as a burst of work would hold it)
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as http, http.get(cluster.gateway_url + "/metrics") as r:
        text = await r.text()
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    count = samples["gateway_event_loop_lag_seconds_count"]
    assert count >= 1
    assert samples['gateway_event_loop_lag_seconds_bucket{le="0.25"}'] <= count - 1
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_resident_memory_bytes"] > 0


async def test_stale_index_entry_after_the_worker_flushed(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    async with aiohttp.ClientSession() as http:
        url = cluster.gateway_url
        await complete(http, url, PREFIX + "first")
        r = await complete(http, url, PREFIX + "second")
        assert int(r.headers["x-cache-matched-tokens"]) > 0
        assert (await misses(http, url))["recent"] == []
        async with http.post(cluster.worker_urls[0] + "/admin/flush") as f:
            assert f.status == 200
        r = await complete(http, url, PREFIX + "third")
        assert r.headers["x-route-reason"].startswith("prefix_hit")
        assert r.headers["x-cache-matched-tokens"] == "0"
        report = await misses(http, url)
        async with http.get(url + "/metrics") as m:
            text = await m.text()
        async with http.get(url + "/admin/workers") as w:
            (predictions,) = [row["predictions"] for row in (await w.json())["workers"]]
    wid = cluster.worker_urls[0].removeprefix("http://")
    recent = report["recent"]
    assert isinstance(recent, list)
    assert len(recent) == 1
    assert recent[0]["cause"] == "stale_index_entry"
    assert recent[0]["worker"] == wid
    assert recent[0]["request_id"] == r.headers["x-request-id"]
    assert recent[0]["predicted_tokens"] > 0
    assert recent[0]["cached_tokens"] == 0
    assert report["by_worker"] == {wid: {"stale_index_entry": 1}}
    assert f'gateway_cache_misses_total{{cause="stale_index_entry",worker="{wid}"}} 1.0' in text
    # The flushed prefix counts as predicted over, by all it was predicted to hold.
    assert predictions["responses"] == 3
    assert predictions["exact"] + predictions["over"] + predictions["under"] == 3
    assert predictions["over"] >= 1
    assert predictions["over_tokens"] >= recent[0]["predicted_tokens"]


async def test_restarted_worker_is_diagnosed(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    worker_url = cluster.worker_urls[0]
    async with aiohttp.ClientSession() as http:
        await complete(http, cluster.gateway_url, PREFIX + "one")
        await cluster.stop_worker(worker_url)
        port = int(worker_url.rsplit(":", 1)[1])
        cluster.runners[worker_url] = await serve(
            create_worker(dataclasses.replace(FAST_WORKER, port=port)), port)
        r = await complete(http, cluster.gateway_url, PREFIX + "two")
        assert r.status == 200
        assert r.headers["x-cache-matched-tokens"] == "0"
        report = await misses(http, cluster.gateway_url)
    recent = report["recent"]
    assert isinstance(recent, list)
    assert [m["cause"] for m in recent] == ["worker_restarted"]


async def prefix_cache_queries(http: aiohttp.ClientSession, worker_url: str) -> float:
    async with http.get(worker_url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_queries_total"))


async def test_a_worker_restarted_in_place_is_diagnosed_as_restarted(
    start_cluster: StartCluster,
) -> None:
    """The reference worker's ``POST /admin/restart`` shows the gateway what a restart in
    place shows (an empty cache, counters back at zero, a new start stamp), where
    ``/admin/flush`` empties the cache alone: the miss that follows is a restart, not a stale
    index entry as after a flush."""
    cluster = await start_cluster(workers=1)
    worker_url = cluster.worker_urls[0]
    async with aiohttp.ClientSession() as http:
        assert (await complete(http, cluster.gateway_url, PREFIX + "one")).status == 200
        before = (await complete(http, worker_url, "x")).headers["x-worker-boot-id"]
        assert await prefix_cache_queries(http, worker_url) > 0
        async with http.post(worker_url + "/admin/restart", json={}) as r:
            assert r.status == 200
            answer = await r.json()
        assert answer["flushed_blocks"] > 0
        assert answer["boot_id"] != before
        assert await prefix_cache_queries(http, worker_url) == 0
        second = await complete(http, cluster.gateway_url, PREFIX + "two")
        assert second.status == 200
        assert second.headers["x-cache-matched-tokens"] == "0"
        report = await misses(http, cluster.gateway_url)
        after = (await complete(http, worker_url, "x")).headers["x-worker-boot-id"]
    assert after == answer["boot_id"]
    recent = report["recent"]
    assert isinstance(recent, list)
    assert [m["cause"] for m in recent] == ["worker_restarted"]


async def workers_view(http: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with http.get(url + "/admin/workers") as r:
        assert r.status == 200
        view: dict[str, object] = await r.json()
        return view


async def test_a_restarted_worker_is_taken_as_one_that_joined(
    start_cluster: StartCluster,
) -> None:
    """A worker that restarted in place, faster than the health probes could see it down,
    is cold and may run other settings: once its new start stamp is seen, the index forgets
    what it modelled there, the warm-up takes it (reason ``restarted``), and its engine is
    asked again whether it takes the copies' scheduling priority (here it now does)."""
    cluster = await start_cluster(workers=1, copy_priority=1)
    url, worker_url = cluster.gateway_url, cluster.worker_urls[0]

    async def view() -> dict[str, object]:
        payload = await workers_view(http, url)
        workers = payload["workers"]
        assert isinstance(workers, list)
        assert len(workers) == 1
        return {**workers[0], "prewarm": payload["prewarm"]}

    async with aiohttp.ClientSession() as http:
        for _ in range(200):  # asked at start-up: first-come-first-served refuses it
            v = await view()
            if v["prewarm"]["copy_priority_refused"]:  # type: ignore[index]
                break
            await asyncio.sleep(0.02)
        wid = v["id"]
        assert v["prewarm"]["copy_priority_refused"] == [wid]  # type: ignore[index]
        assert (await complete(http, url, PREFIX + "one")).status == 200
        assert (await view())["modelled_blocks"] > 0  # type: ignore[operator]
        await cluster.stop_worker(worker_url)
        port = int(worker_url.rsplit(":", 1)[1])
        cluster.runners[worker_url] = await serve(create_worker(dataclasses.replace(
            FAST_WORKER, port=port, scheduling_policy="priority")), port)
        r = await complete(http, url, PREFIX + "two")
        assert r.status == 200
        assert r.headers["x-cache-matched-tokens"] == "0"
        for _ in range(200):
            v = await view()
            if v["prewarm"]["copy_priority_taken"]:  # type: ignore[index]
                break
            await asyncio.sleep(0.02)
    assert v["warmup"]["reason"] == "restarted"  # type: ignore[index]
    assert v["prewarm"]["copy_priority_taken"] == [wid]  # type: ignore[index]
    assert v["prewarm"]["copy_priority_refused"] == []  # type: ignore[index]
    # Forgotten as the reply showed the restart (with the prefix of the request that showed
    # it: the index learns the worker's new cache from the requests after it).
    assert v["modelled_blocks"] == 0


async def test_same_prompt_for_another_tenant_is_diagnosed(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2)
    async with aiohttp.ClientSession() as http:
        await complete(http, cluster.gateway_url, PREFIX + "q", key="key-a")
        await complete(http, cluster.gateway_url, PREFIX + "q", key="key-b")
        report = await misses(http, cluster.gateway_url)
    recent = report["recent"]
    assert isinstance(recent, list)
    assert [m["cause"] for m in recent] == [
        "tenant_or_model_changed"]


async def test_explain_is_a_dry_run_that_predicts_the_decision(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=3)
    url = cluster.gateway_url
    auth = {"Authorization": "Bearer key-a"}
    chat = {"model": MODEL, "messages": [{"role": "system", "content": PREFIX},
                                         {"role": "user", "content": SECRET}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/admin/explain", json=chat, headers=auth) as r:
            assert r.status == 200
            cold = await r.json()
            raw = await r.text()
        async with http.get(url + "/admin/workers") as r:
            view = await r.json()
            assert view["index_blocks"] == 0  # nothing was recorded
            assert {w["engine"] for w in view["workers"]} == {REFERENCE_OWNER}
            assert view["prewarm"] == {"enabled": True, "sent": 0, "placed": 0, "failed": 0,
                                       "inflight": 0, "used": 0, "cut": 0, "sessions": 0,
                                       "copies_done": 0, "copy_seconds": 0.0,
                                       "copies_waited": 0, "copy_priority": 0,
                                       "copy_priority_taken": [], "copy_priority_refused": []}
        async with http.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 2},
                             headers=auth) as r:
            sent_to = r.headers["x-route-worker"]
        async with http.post(url + "/admin/explain", json=chat, headers=auth) as r:
            warm = await r.json()
        async with http.post(url + "/admin/explain", json={"model": MODEL},
                             headers=auth) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
    assert SECRET not in raw
    assert "railway" not in raw
    assert cold["dry_run"] is True
    assert cold["decision"]["kind"] == "cold"
    assert cold["fingerprint"]["kind"] == "chat"
    assert cold["fingerprint"]["blocks"] > 10
    assert len(cold["candidates"]) == 3
    assert all(c["match_blocks"] == 0 for c in cold["candidates"])
    assert warm["decision"]["kind"] == "prefix_hit"
    assert warm["decision"]["worker"] == sent_to
    by_worker = {c["worker"]: c for c in warm["candidates"]}
    assert by_worker[sent_to]["match_blocks"] == warm["fingerprint"]["blocks"]
    assert by_worker[sent_to]["cost"] == min(c["cost"] for c in warm["candidates"])


async def test_retrieve_one_model(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    async with client(cluster.base_url) as oa:
        model = await oa.models.retrieve(MODEL)
        assert model.id == MODEL
        with pytest.raises(openai.NotFoundError):
            await oa.models.retrieve("other-model")
