"""The reference worker with data-parallel ranks (``--data-parallel-size``) over real HTTP and
real ZMQ sockets on 127.0.0.1: ``X-data-parallel-rank`` pins a rank and its cache, unpinned
requests go to the least loaded rank, and ``/metrics``, ``/stats``, ``/admin/flush`` and the
KV events speak for each rank as vLLM's do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from gateway.contracts.kv_wire import END_SEQ, BlockStored, EventBatch, decode_batch
from gateway.contracts.kv_wire import encode_seq as seq_bytes
from tests.conftest import free_port, free_ports, serve, until
from worker.server import create_app
from worker.settings import WorkerSettings

MODEL = "dp-model"
RANK = "X-data-parallel-rank"
SETTINGS = WorkerSettings(
    model=MODEL, cache_blocks=128, block_size=16, max_running=4, prefill_us_per_token=0.0,
    prefill_us_per_cached_token=0.0, decode_ms_per_token=0.0, worker_id="dp-test",
)
PROMPT = "Every rank keeps a KV cache of its own, and a pinned prompt stays in one. " * 8


@dataclasses.dataclass
class Worker:
    url: str
    session: aiohttp.ClientSession

    async def complete(self, prompt: str | list[int] = PROMPT, rank: str | None = None,
                       **body: Any) -> aiohttp.ClientResponse:
        headers = {RANK: rank} if rank is not None else {}
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **body}
        async with self.session.post(f"{self.url}/v1/completions", json=payload,
                                     headers=headers) as resp:
            await resp.read()
            return resp

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self.url + path) as resp:
            assert resp.status == 200
            return await resp.json()

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


@contextlib.asynccontextmanager
async def running(settings: WorkerSettings) -> AsyncIterator[Worker]:
    port = free_port()
    runner = await serve(create_app(dataclasses.replace(settings, port=port)), port)
    try:
        async with aiohttp.ClientSession() as session:
            yield Worker(f"http://127.0.0.1:{port}", session)
    finally:
        await runner.cleanup()


@pytest.fixture
async def two_ranks() -> AsyncIterator[Worker]:
    async with running(dataclasses.replace(SETTINGS, data_parallel_size=2)) as worker:
        yield worker


@pytest.fixture
async def one_rank() -> AsyncIterator[Worker]:
    async with running(SETTINGS) as worker:
        yield worker


def matched(resp: aiohttp.ClientResponse) -> int:
    return int(resp.headers["x-cache-matched-tokens"])


async def test_the_header_pins_a_rank_and_its_cache(two_ranks: Worker) -> None:
    cold = await two_ranks.complete(rank="1")
    warm = await two_ranks.complete(rank="1")
    assert (cold.status, warm.status) == (200, 200)
    assert cold.headers["x-data-parallel-rank"] == warm.headers["x-data-parallel-rank"] == "1"
    assert matched(cold) == 0
    assert matched(warm) > 0
    stats = await two_ranks.get_json("/stats")
    zero, one = stats["ranks"]
    assert (zero["rank"], one["rank"]) == (0, 1)
    assert zero["requests_admitted"] == 0
    assert zero["cache"]["queries_tokens"] == 0
    assert zero["cache"]["used_blocks"] == 0
    assert one["requests_admitted"] == 2
    assert one["cache"]["hit_tokens"] == matched(warm)
    # The other rank's cache does not have it.
    other = await two_ranks.complete(rank="0")
    assert matched(other) == 0
    assert other.headers["x-data-parallel-rank"] == "0"


async def test_the_bodys_data_parallel_rank_pins_a_rank_as_sglang_reads_it(
    two_ranks: Worker,
) -> None:
    cold = await two_ranks.complete(data_parallel_rank=1)
    warm = await two_ranks.complete(data_parallel_rank=1)
    assert [r.headers["x-data-parallel-rank"] for r in (cold, warm)] == ["1", "1"]
    assert matched(warm) > 0
    # The header, vLLM's, wins over the body's field.
    both = await two_ranks.complete(rank="0", data_parallel_rank=1)
    assert both.headers["x-data-parallel-rank"] == "0"
    for bad in (2, -1, "1", True):
        resp = await two_ranks.complete(data_parallel_rank=bad)
        assert resp.status == 400
        async with two_ranks.session.post(
                f"{two_ranks.url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "data_parallel_rank": bad}) as again:
            error = (await again.json())["error"]
        assert error["param"] == "data_parallel_rank"


async def test_without_the_header_idle_ranks_share_the_requests(two_ranks: Worker) -> None:
    ranks = []
    for i in range(4):
        resp = await two_ranks.complete(f"question {i} " * 20)
        assert resp.status == 200
        ranks.append(resp.headers["x-data-parallel-rank"])
    assert ranks == ["0", "1", "0", "1"]
    stats = await two_ranks.get_json("/stats")
    assert [r["requests_admitted"] for r in stats["ranks"]] == [2, 2]


async def test_a_busy_rank_is_passed_over_and_streams_name_their_rank() -> None:
    # Decoding slow enough that a stream runs until the test closes it.
    slow = dataclasses.replace(SETTINGS, data_parallel_size=2, decode_ms_per_token=50.0)
    async with running(slow) as worker:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "stream": True}
        async with worker.session.post(f"{worker.url}/v1/completions", json=body,
                                       headers={RANK: "0"}) as stream:
            # Headers go out once the prompt is admitted: rank 0 now runs it.
            assert stream.status == 200
            assert stream.headers["x-data-parallel-rank"] == "0"
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            for i in range(3):
                resp = await worker.complete(f"other {i} " * 20)
                assert resp.headers["x-data-parallel-rank"] == "1"
            stats = await worker.get_json("/stats")
            assert [r["running"] for r in stats["ranks"]] == [1, 0]
            assert stats["running"] == 1
        # The client went away mid-stream: counted as rank 0's abort.

        async def aborted() -> bool:
            return 'worker_requests_aborted_total{engine="0",model_name="dp-model",' \
                'stage="running"} 1.0' in await worker.metrics()

        await until(aborted)


@pytest.mark.parametrize("value", ["x", "-1", "2", "1.5", "+1", "0x1"])
async def test_a_header_that_names_no_rank_is_a_400(two_ranks: Worker, value: str) -> None:
    resp = await two_ranks.complete(rank=value)
    assert resp.status == 400
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_value"
    assert "X-data-parallel-rank" in body["error"]["message"]
    assert "from 0 to 1" in body["error"]["message"]
    assert "x-data-parallel-rank" not in resp.headers
    stats = await two_ranks.get_json("/stats")
    assert stats["requests_admitted"] == 0


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/responses", {"input": "hi"}),
])
async def test_every_generation_route_takes_the_header(
    two_ranks: Worker, path: str, body: dict[str, Any],
) -> None:
    payload = {"model": MODEL, "max_tokens": 2, **body}
    if path == "/v1/responses":
        payload = {"model": MODEL, "max_output_tokens": 2, **body}
    for rank in ("1", "1"):
        async with two_ranks.session.post(two_ranks.url + path, json=payload,
                                          headers={RANK: rank}) as resp:
            await resp.read()
            assert resp.status == 200
            assert resp.headers["x-data-parallel-rank"] == rank
    async with two_ranks.session.post(two_ranks.url + path, json=payload,
                                      headers={RANK: "5"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_value"
    stats = await two_ranks.get_json("/stats")
    assert [r["requests_admitted"] for r in stats["ranks"]] == [0, 2]


async def test_one_rank_answers_rank_0_only_and_as_before(one_rank: Worker) -> None:
    pinned = await one_rank.complete(rank="0")
    plain = await one_rank.complete()
    assert (pinned.status, plain.status) == (200, 200)
    assert "x-data-parallel-rank" not in pinned.headers
    assert "x-data-parallel-rank" not in plain.headers
    assert matched(plain) > 0  # one cache: the second request hit the first's blocks
    refused = await one_rank.complete(rank="1")
    assert refused.status == 400
    error = (await refused.json())["error"]
    assert error["code"] == "invalid_value"
    assert "from 0 to 0" in error["message"]
    stats = await one_rank.get_json("/stats")
    assert stats["data_parallel_size"] == 1
    assert "ranks" not in stats
    assert stats["requests_admitted"] == 2
    info = await one_rank.get_json("/server_info")
    assert info["dp_size"] == 1
    assert info["max_total_num_tokens"] == 128 * 16


def samples(text: str, name: str) -> dict[str, dict[str, str]]:
    """The samples called ``name`` on a metrics page: the engine label -> all labels."""
    found: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels.get("engine", "")] = dict(sample.labels)
                found[sample.labels.get("engine", "")]["value"] = str(sample.value)
    return found


async def test_metrics_label_each_rank(two_ranks: Worker) -> None:
    await two_ranks.complete(rank="1")
    await two_ranks.complete(rank="1")
    text = await two_ranks.metrics()
    running_ = samples(text, "vllm:num_requests_running")
    assert set(running_) == {"0", "1"}
    assert running_["1"]["model_name"] == MODEL
    queries = samples(text, "vllm:prefix_cache_queries_total")
    hits = samples(text, "vllm:prefix_cache_hits_total")
    assert set(queries) == set(hits) == {"0", "1"}
    assert float(queries["0"]["value"]) == 0.0
    assert float(queries["1"]["value"]) > 0.0
    assert float(hits["1"]["value"]) > 0.0
    info = samples(text, "vllm:cache_config_info")
    assert set(info) == {"0", "1"}
    for rank in ("0", "1"):
        assert info[rank] == {"block_size": "16", "num_gpu_blocks": "128", "engine": rank,
                              "value": "1.0"}
    ttft = samples(text, "vllm:time_to_first_token_seconds_count")
    assert {r: v["value"] for r, v in ttft.items()} == {"0": "0.0", "1": "2.0"}
    e2e = samples(text, "vllm:e2e_request_latency_seconds_count")
    assert {r: v["value"] for r, v in e2e.items()} == {"0": "0.0", "1": "2.0"}
    # One HELP/TYPE per family, whatever the ranks.
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


async def test_one_rank_has_no_engine_label(one_rank: Worker) -> None:
    await one_rank.complete()
    await one_rank.complete(rank="0")
    text = await one_rank.metrics()
    assert "engine=" not in text
    assert samples(text, "vllm:prefix_cache_queries_total")[""]["model_name"] == MODEL
    info = samples(text, "vllm:cache_config_info")[""]
    assert info == {"block_size": "16", "num_gpu_blocks": "128", "value": "1.0"}


_TOTALED = ("running", "waiting", "max_running", "requests_admitted", "requests_finished",
            "prompt_tokens", "generation_tokens")
_CACHE_TOTALED = ("num_blocks", "free_blocks", "referenced_blocks", "cached_blocks",
                  "used_blocks", "queries_tokens", "hit_tokens", "evicted_blocks",
                  "running_requests")


async def test_stats_totals_are_the_sums_of_the_ranks(two_ranks: Worker) -> None:
    for rank in ("0", "1", "1", "1"):
        await two_ranks.complete(rank=rank, cache_priority="document")
    await two_ranks.complete("a different prompt " * 30, rank="0")
    stats = await two_ranks.get_json("/stats")
    ranks = stats["ranks"]
    assert stats["data_parallel_size"] == len(ranks) == 2
    for key in _TOTALED:
        assert stats[key] == sum(r[key] for r in ranks), key
    for key in _CACHE_TOTALED:
        assert stats["cache"][key] == sum(r["cache"][key] for r in ranks), key
    assert stats["requests_admitted"] == 5
    assert stats["cache"]["num_blocks"] == 256
    cache = stats["cache"]
    assert cache["hit_tokens"] > 0
    assert cache["hit_rate"] == pytest.approx(cache["hit_tokens"] / cache["queries_tokens"])
    assert cache["occupancy"] == pytest.approx(cache["used_blocks"] / cache["num_blocks"])
    by_priority = cache["cached_blocks_by_priority"]
    for key, value in by_priority.items():
        assert value == sum(r["cache"]["cached_blocks_by_priority"][key] for r in ranks)
    assert by_priority["document"] > 0
    assert stats["worker_id"] == ranks[0]["worker_id"] == "dp-test"
    info = await two_ranks.get_json("/server_info")
    assert info["dp_size"] == 2
    assert info["max_total_num_tokens"] == 128 * 16  # one rank's cache


async def test_flush_empties_every_rank(two_ranks: Worker) -> None:
    await two_ranks.complete(rank="0")
    await two_ranks.complete("the other rank's prompt " * 20, rank="1")
    before = await two_ranks.get_json("/stats")
    held = [r["cache"]["cached_blocks"] for r in before["ranks"]]
    assert all(blocks > 0 for blocks in held)
    async with two_ranks.session.post(two_ranks.url + "/admin/flush") as resp:
        assert resp.status == 200
        assert (await resp.json())["flushed_blocks"] == sum(held)
    after = await two_ranks.get_json("/stats")
    assert [r["cache"]["used_blocks"] for r in after["ranks"]] == [0, 0]
    again = await two_ranks.complete("the other rank's prompt " * 20, rank="1")
    assert matched(again) == 0


async def replayed(ctx: zmq.asyncio.Context, endpoint: str) -> list[EventBatch]:
    """Every batch a replay socket still holds."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", seq_bytes(0)])
        batches: list[EventBatch] = []
        while True:
            _, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 10.0)
            if seq == END_SEQ:
                return batches
            batches.append(decode_batch(payload))
    finally:
        dealer.close()


def stored(batches: list[EventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


async def test_each_rank_publishes_its_events_at_its_ports() -> None:
    ev, rp = free_ports(2), free_ports(2)
    settings = dataclasses.replace(
        SETTINGS, data_parallel_size=2, kv_events=f"tcp://127.0.0.1:{ev}",
        kv_replay=f"tcp://127.0.0.1:{rp}",
    )
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with running(settings) as worker:
            sub.connect(f"tcp://127.0.0.1:{ev + 1}")
            tokens = list(range(100, 100 + 4 * 16))
            first = await worker.complete(tokens, rank="1")
            assert first.status == 200
            # Replay serves what was published before the subscription joined.
            one = await replayed(ctx, f"tcp://127.0.0.1:{rp + 1}")
            assert one
            assert {b.data_parallel_rank for b in one} == {1}
            assert stored(one)[0].token_ids[:16] == tuple(tokens[:16])
            assert await replayed(ctx, f"tcp://127.0.0.1:{rp}") == []
            # Live: rank 1's PUB socket at the events port + 1 carries rank 1's batches.
            live: list[EventBatch] = []
            for i in range(200):
                await worker.complete([7, i, *tokens], rank="1")
                with contextlib.suppress(TimeoutError):
                    _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 0.1)
                    live.append(decode_batch(payload))
                    break
            assert live
            assert live[0].data_parallel_rank == 1
            assert stored(live)
            # Rank 0's events stay at the configured ports, with rank 0 in the batch.
            await worker.complete(tokens, rank="0")
            zero = await replayed(ctx, f"tcp://127.0.0.1:{rp}")
            assert zero
            assert {b.data_parallel_rank for b in zero} == {0}
            assert stored(zero)[0].token_ids[:16] == tuple(tokens[:16])
    finally:
        sub.close()
        ctx.term()


@pytest.mark.parametrize("taken", ["events", "replay"])
async def test_a_rank_whose_port_is_taken_fails_the_start(taken: str) -> None:
    ev, rp = free_ports(2), free_ports(2)
    settings = dataclasses.replace(
        SETTINGS, data_parallel_size=2, kv_events=f"tcp://127.0.0.1:{ev}",
        kv_replay=f"tcp://127.0.0.1:{rp}",
    )
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", (ev if taken == "events" else rp) + 1))
        busy.listen()
        # Rank 0 started, rank 1 cannot bind: the start fails, and rank 0's sockets close
        # (an open one would block the ZMQ context's termination for good).
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            await asyncio.wait_for(serve(create_app(dataclasses.replace(settings, port=port)),
                                         port), 10.0)
    # Rank 0's ports are free again.
    for endpoint_port in (ev, rp):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", endpoint_port))
