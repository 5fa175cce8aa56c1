"""TorchEngine: greedy output is the same with and without reuse; namespaces; flush; admission."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (optional extra: pip install '.[torch]')"
)

from worker.engines import torch_engine  # noqa: E402
from worker.engines.base import GenerationRequest, RequestRejectedError  # noqa: E402
from worker.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from worker.server import build_engines  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402
from worker.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(cache_blocks: int = 64, kv_dtype: str = "float32", max_running: int = 4) -> TorchEngine:
    config = TorchEngineConfig(model_config="tiny", device="cpu", cache_blocks=cache_blocks,
                               kv_dtype=kv_dtype, max_running=max_running)
    return TorchEngine.build(config, detokenize=lambda t: f" t{t}")


async def generate(engine: TorchEngine, rid: str, tokens: list[int], max_tokens: int = 12,
                   namespace: str = "") -> tuple[list[str], int]:
    """(output pieces, matched tokens)."""
    async with engine.admit(GenerationRequest(rid, tokens, max_tokens, namespace)) as gen:
        pieces = [p async for p in gen.tokens()]
        return pieces, gen.admission.matched_tokens


PROMPT = [random.Random(0).randrange(512) for _ in range(53)]


async def test_greedy_generation_is_identical_with_and_without_reuse() -> None:
    engine = make()
    try:
        cold, cold_matched = await generate(engine, "a", PROMPT)
        warm, warm_matched = await generate(engine, "b", PROMPT)
        longer, longer_matched = await generate(engine, "c", [*PROMPT, 7, 8, 9])
    finally:
        engine.close()
    fresh = make()
    try:
        reference, _ = await generate(fresh, "x", [*PROMPT, 7, 8, 9])
    finally:
        fresh.close()
    assert (cold_matched, warm_matched, longer_matched) == (0, 48, 48)
    assert cold == warm
    assert len(cold) == 12
    assert longer == reference
    stats = engine.stats()
    assert stats.generation_tokens == 36
    assert stats.cache.hit_tokens == 96
    assert stats.prefill_seconds > 0.0
    assert stats.cache.referenced_blocks == 0


async def test_concurrent_requests_sharing_a_prefix_agree_with_sequential_ones() -> None:
    engine = make()
    try:
        suffixes = [[1], [2, 3], [4, 5, 6]]
        together = await asyncio.gather(*(
            generate(engine, f"r{i}", PROMPT + s, max_tokens=6) for i, s in enumerate(suffixes)
        ))
    finally:
        engine.close()
    for i, s in enumerate(suffixes):
        alone = make()
        try:
            expected, _ = await generate(alone, "solo", PROMPT + s, max_tokens=6)
        finally:
            alone.close()
        assert together[i][0] == expected
    assert sum(matched for _, matched in together) > 0  # later ones reused the first's blocks


async def test_identical_prompts_in_two_namespaces_share_nothing() -> None:
    engine = make()
    try:
        async with engine.admit(GenerationRequest("a", PROMPT, 4, "tenant-a")) as ga:
            async with engine.admit(GenerationRequest("b", PROMPT, 4, "tenant-b")) as gb:
                assert gb.admission.matched_tokens == 0
                blocks_a = engine.cache.allocation("a")
                blocks_b = engine.cache.allocation("b")
                assert blocks_a is not None
                assert blocks_b is not None
                assert not set(blocks_a.block_ids) & set(blocks_b.block_ids)
                out_b = [p async for p in gb.tokens()]
            out_a = [p async for p in ga.tokens()]
        assert out_a == out_b  # same model, same prompt: same answer, computed twice
        _, same_ns = await generate(engine, "c", PROMPT, namespace="tenant-a")
        assert same_ns == 48
    finally:
        engine.close()


async def test_flush_empties_the_cache() -> None:
    engine = make()
    try:
        await generate(engine, "a", PROMPT, namespace="t1")
        await generate(engine, "b", PROMPT, namespace="t2")
        assert engine.flush("t1") == 3
        assert (await generate(engine, "c", PROMPT, namespace="t1"))[1] == 0
        assert (await generate(engine, "d", PROMPT, namespace="t2"))[1] == 48
        assert engine.flush() == 6
        assert engine.stats().cache.used_blocks == 0
    finally:
        engine.close()


async def test_int8_engine_reports_its_pool() -> None:
    engine = make(kv_dtype="int8")
    try:
        pieces, _ = await generate(engine, "a", PROMPT)
        assert len(pieces) == 12
        info = engine.info()
        assert info["kv_dtype"] == "int8"
        assert info["kv_bytes_per_token"] < make_info_fp32_bytes() / 3.5
    finally:
        engine.close()


def make_info_fp32_bytes() -> float:
    engine = make()
    engine.close()
    value: float = engine.info()["kv_bytes_per_token"]
    return value


async def test_requests_wait_for_blocks_and_are_rejected_when_too_big() -> None:
    engine = make(cache_blocks=5, max_running=4)
    try:
        with pytest.raises(RequestRejectedError, match="exceeds the KV cache"):
            async with engine.admit(GenerationRequest("huge", PROMPT, 40)):
                pass
        # Each needs 4 blocks (53 + 11 slots): the second waits for the first to finish.
        results = await asyncio.gather(
            generate(engine, "a", PROMPT), generate(engine, "b", PROMPT)
        )
        assert results[0][0] == results[1][0]
        assert engine.stats().cache.referenced_blocks == 0
    finally:
        engine.close()


async def test_cancelled_consumer_releases_blocks_and_leaves_nothing_stale() -> None:
    engine = make()
    try:
        async def consume() -> None:
            async with engine.admit(GenerationRequest("x", PROMPT, 500)) as gen:
                async for _ in gen.tokens():
                    await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        for _ in range(200):
            if engine.stats().generation_tokens >= 2:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.stats().running == 0
        assert engine.stats().cache.referenced_blocks == 0
        again, matched = await generate(engine, "y", PROMPT)
        fresh = make()
        try:
            expected, _ = await generate(fresh, "z", PROMPT)
        finally:
            fresh.close()
        assert matched == 48
        assert again == expected
    finally:
        engine.close()


async def test_empty_prompt_runs() -> None:
    engine = make()
    try:
        pieces, matched = await generate(engine, "e", [], max_tokens=3)
    finally:
        engine.close()
    assert (len(pieces), matched) == (3, 0)


def test_every_data_parallel_rank_gets_the_first_ranks_automatic_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The memory each rank would find when built: less after every rank already loaded.
    left = iter([16 * 2**20, 8 * 2**20, 4 * 2**20])
    monkeypatch.setattr(torch_engine, "available_memory", lambda device: next(left))
    settings = WorkerSettings(engine="torch", model_config="tiny", device="cpu",
                              cache_blocks=0, cache_memory_fraction=0.5, data_parallel_size=3)
    engines = build_engines(settings, load_tokenizer(settings.tokenizer_file, settings.tokenizer))
    sizes = [engine.stats().cache.num_blocks for engine in engines]
    assert sizes[0] > 1
    assert sizes == [sizes[0]] * 3
