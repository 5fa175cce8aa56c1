"""SimEngine: admission control and the simulated cost accounting (never wall-clock timing)."""

from __future__ import annotations

import asyncio

import pytest

from worker.engines import GenerationRequest, RequestRejectedError, SimCosts, SimEngine
from worker.engines.sim import pseudo_words
from worker.kvcache import PrefixCache, Reuse

NO_WAIT = SimCosts(prefill_us_per_token=0.0, prefill_us_per_cached_token=0.0,
                   decode_ms_per_token=0.0)


def engine(*, num_blocks: int = 64, block_size: int = 16, max_running: int = 2,
           costs: SimCosts = NO_WAIT) -> SimEngine:
    return SimEngine(PrefixCache(num_blocks, block_size), max_running=max_running, costs=costs)


def req(rid: str, tokens: list[int], max_tokens: int = 3, namespace: str = "") -> GenerationRequest:
    return GenerationRequest(rid, tokens, max_tokens, namespace)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Holder:
    """Runs requests that stay admitted until released, recording admission order."""

    def __init__(self, eng: SimEngine) -> None:
        self.eng = eng
        self.admitted: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, rid: str, tokens: list[int]) -> None:
        self.gates[rid] = asyncio.Event()
        self.tasks[rid] = asyncio.create_task(self._hold(rid, tokens))

    async def _hold(self, rid: str, tokens: list[int]) -> None:
        async with self.eng.admit(req(rid, tokens)):
            self.admitted.append(rid)
            await self.gates[rid].wait()

    async def finish(self, rid: str) -> None:
        self.gates[rid].set()
        await self.tasks[rid]
        await settle()


async def test_admission_respects_max_running_in_fifo_order() -> None:
    eng = engine(max_running=2)
    holder = Holder(eng)
    for i in range(5):
        holder.start(f"r{i}", [i] * 20)
        await settle()
    assert holder.admitted == ["r0", "r1"]
    assert (eng.running, eng.waiting) == (2, 3)
    await holder.finish("r1")
    assert holder.admitted == ["r0", "r1", "r2"]
    assert (eng.running, eng.waiting) == (2, 2)
    for rid in ("r0", "r2", "r3", "r4"):
        await holder.finish(rid)
    assert holder.admitted == ["r0", "r1", "r2", "r3", "r4"]
    stats = eng.stats()
    assert (stats.running, stats.waiting, stats.requests_finished) == (0, 0, 5)
    assert stats.cache.referenced_blocks == 0


async def test_request_waits_while_blocks_are_referenced() -> None:
    eng = engine(num_blocks=4, block_size=4, max_running=8)
    holder = Holder(eng)
    holder.start("big", list(range(12)))  # 3 of 4 blocks
    await settle()
    holder.start("other", list(range(100, 108)))  # needs 2 blocks: must wait
    holder.start("small", [7])  # would fit, but FIFO keeps it behind "other"
    await settle()
    assert holder.admitted == ["big"]
    assert (eng.running, eng.waiting) == (1, 2)
    await holder.finish("big")
    assert holder.admitted == ["big", "other", "small"]
    await holder.finish("other")
    await holder.finish("small")


async def test_cancelled_waiter_leaves_the_queue() -> None:
    eng = engine(max_running=1)
    holder = Holder(eng)
    holder.start("a", [1] * 20)
    holder.start("b", [2] * 20)
    holder.start("c", [3] * 20)
    await settle()
    holder.tasks["b"].cancel()
    await settle()
    assert eng.waiting == 1
    await holder.finish("a")
    assert holder.admitted == ["a", "c"]
    await holder.finish("c")
    assert eng.stats().cache.referenced_blocks == 0


async def test_blocks_are_released_when_the_consumer_is_cancelled() -> None:
    eng = engine()

    async def consume() -> None:
        async with eng.admit(req("x", [1] * 40, max_tokens=1000)) as gen:
            async for _ in gen.tokens():
                await asyncio.sleep(0)

    task = asyncio.create_task(consume())
    await settle()
    assert eng.running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert eng.running == 0
    assert eng.stats().cache.referenced_blocks == 0


def test_cost_model_arithmetic() -> None:
    costs = SimCosts(prefill_us_per_token=200.0, prefill_us_per_cached_token=5.0,
                     decode_ms_per_token=5.0)
    assert costs.prefill_seconds(uncached_tokens=1000, cached_tokens=0) == pytest.approx(0.2)
    assert costs.prefill_seconds(uncached_tokens=8, cached_tokens=992) == pytest.approx(
        (8 * 200 + 992 * 5) / 1e6
    )
    assert costs.decode_seconds(1) == 0.0  # the first token comes out of prefill
    assert costs.decode_seconds(16) == pytest.approx(0.075)


async def test_cache_hit_lowers_simulated_prefill_cost() -> None:
    costs = SimCosts(prefill_us_per_token=200.0, prefill_us_per_cached_token=5.0,
                     decode_ms_per_token=0.0)
    eng = engine(block_size=16, costs=costs)
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    async with eng.admit(req("cold", prompt)) as gen:
        cold = gen.admission
        cold_text = [p async for p in gen.tokens()]
    async with eng.admit(req("warm", prompt)) as gen:
        warm = gen.admission
        warm_text = [p async for p in gen.tokens()]
    assert (cold.input_tokens, cold.matched_tokens, cold.matched_blocks) == (40, 0, 0)
    assert cold.cache_hit_ratio == 0.0
    assert cold.prefill_seconds == pytest.approx(40 * 200 / 1e6)
    assert (warm.input_tokens, warm.matched_tokens, warm.matched_blocks) == (40, 32, 2)
    assert warm.cache_hit_ratio == pytest.approx(0.8)
    assert warm.prefill_seconds == pytest.approx((8 * 200 + 32 * 5) / 1e6)
    assert warm.prefill_seconds < cold.prefill_seconds
    assert eng.stats().prefill_seconds == pytest.approx(cold.prefill_seconds + warm.prefill_seconds)
    assert cold_text == warm_text  # output depends on the prompt only
    assert len(cold_text) == 3


async def test_namespace_isolates_the_cache() -> None:
    eng = engine()
    prompt = list(range(40))
    async with eng.admit(req("a", prompt, namespace="tenant-a")):
        pass
    async with eng.admit(req("b", prompt, namespace="tenant-b")) as gen:
        assert gen.admission.matched_tokens == 0


async def test_empty_prompt_has_zero_hit_ratio() -> None:
    eng = engine()
    async with eng.admit(req("e", [])) as gen:
        assert gen.admission.input_tokens == 0
        assert gen.admission.cache_hit_ratio == 0.0
        assert len([p async for p in gen.tokens()]) == 3


async def test_prompt_larger_than_the_cache_is_rejected() -> None:
    eng = engine(num_blocks=2, block_size=4)
    with pytest.raises(RequestRejectedError):
        async with eng.admit(req("huge", list(range(9)))):
            pass
    assert eng.waiting == 0


def test_pseudo_words_are_deterministic() -> None:
    assert pseudo_words([1, 2, 3], 5) == pseudo_words([1, 2, 3], 5)
    assert pseudo_words([1, 2, 3], 8) != pseudo_words([3, 2, 1], 8)
    assert all(w.startswith(" ") for w in pseudo_words([1], 10))
    # The samples of one request (n > 1) differ; the first is the request's only output.
    assert pseudo_words([1, 2, 3], 8, 0) == pseudo_words([1, 2, 3], 8)
    assert len({tuple(pseudo_words([1, 2, 3], 8, j)) for j in range(4)}) == 4


async def test_waiters_cancelled_in_the_tick_a_slot_frees_get_nothing() -> None:
    # Many clients leave at once: their waiting futures are cancelled, and before their tasks
    # resume, a running request ends and the queue hands out its slot. The cancelled waiters
    # must be skipped (no slot, no blocks), and the next live waiter admitted.
    eng = engine(max_running=1)
    holder = Holder(eng)
    holder.start("a", [1] * 20)
    for rid in ("b", "c", "d"):
        holder.start(rid, [ord(rid)] * 20)
    await settle()
    assert (eng.running, eng.waiting) == (1, 3)
    holder.gates["a"].set()  # "a" resumes first and ends, in the tick of the cancellations
    holder.tasks["b"].cancel()
    holder.tasks["c"].cancel()
    await settle()
    assert holder.tasks["b"].cancelled()
    assert holder.tasks["c"].cancelled()
    assert holder.admitted == ["a", "d"]
    assert (eng.running, eng.waiting) == (1, 0)
    await holder.finish("d")
    stats = eng.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.cache.referenced_blocks == 0


async def test_a_request_reusing_a_prefill_under_way_answers_once_it_is_computed() -> None:
    """vLLM's rule (``Reuse.SCHEDULED``): B, admitted while A is computing a 96-token prompt,
    reuses its blocks (and computes only its own 32 tokens), and its first token comes once A
    computed them; C, admitted before the engine began A's work, would have computed them."""
    costs = SimCosts(prefill_us_per_token=1000.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    eng = SimEngine(PrefixCache(64, 16, reuse=Reuse.SCHEDULED), max_running=4, costs=costs)
    loop = asyncio.get_running_loop()
    prompt = list(range(96))
    firsts: dict[str, float] = {}
    matched: dict[str, int] = {}

    async def answer(rid: str, tokens: list[int], after_s: float) -> None:
        await asyncio.sleep(after_s)
        async with eng.admit(req(rid, tokens, max_tokens=1)) as generation:
            matched[rid] = generation.admission.matched_tokens
            async for _ in generation.tokens():
                firsts[rid] = loop.time()

    start = loop.time()
    await asyncio.gather(answer("a", prompt, 0.0), answer("b", [*prompt, *range(500, 532)], 0.01))
    assert matched == {"a": 0, "b": 96}
    assert firsts["a"] - start >= 0.096 - 0.002  # 96 tokens at 1 ms
    assert firsts["b"] >= firsts["a"]  # its own 32 ms end before A's 96: it waited for A


async def test_a_reuser_goes_on_when_the_request_it_waits_for_is_given_up() -> None:
    """B reuses the blocks A began computing and waits for A; A's client goes away before A
    is done: A's blocks stay cached (the engine's step completes them), and B answers."""
    costs = SimCosts(prefill_us_per_token=1000.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0)
    cache = PrefixCache(64, 16, reuse=Reuse.SCHEDULED)
    eng = SimEngine(cache, max_running=4, costs=costs)
    prompt = list(range(96))

    async def answer(rid: str, tokens: list[int]) -> int:
        async with eng.admit(req(rid, tokens, max_tokens=1)) as generation:
            async for _ in generation.tokens():
                pass
            return generation.admission.matched_tokens

    a = asyncio.create_task(answer("a", prompt))
    await asyncio.sleep(0.01)
    b = asyncio.create_task(answer("b", [*prompt, *range(500, 516)]))
    await asyncio.sleep(0.01)
    assert cache.computing("a")
    a.cancel()
    assert await asyncio.wait_for(b, 1.0) == 96
    assert not cache.computing("a")
    assert cache.lookup(prompt) == 96
