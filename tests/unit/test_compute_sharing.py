"""Prefill compute shared by the requests in prefill: the bookkeeping on explicit times, and
the order in which the loop-driven version ends prefills (no wall-clock figure is asserted
beyond the work done: an engine never finishes faster than its compute allows)."""

from __future__ import annotations

import asyncio
import time

import pytest

from worker.engines import GenerationRequest, SimCosts, SimEngine
from worker.engines.compute import ProcessorSharing, SharedCompute
from worker.kvcache import PrefixCache


def test_jobs_started_together_share_the_engine() -> None:
    ps = ProcessorSharing()
    ps.add(1, 1.0, 0.0)
    ps.add(2, 1.0, 0.0)
    assert ps.next_end() == pytest.approx(2.0)
    assert ps.advance(1.9) == []
    assert sorted(ps.advance(2.0)) == [1, 2]
    assert len(ps) == 0
    assert ps.next_end() is None


def test_a_short_job_arriving_later_ends_first_and_the_long_one_after_the_work() -> None:
    ps = ProcessorSharing()
    ps.add(1, 1.0, 0.0)  # alone until 0.5: 0.5 left
    ps.add(2, 0.25, 0.5)  # then each at half speed
    assert ps.next_end() == pytest.approx(1.0)
    assert ps.advance(1.0) == [2]
    assert ps.next_end() == pytest.approx(1.25)  # the 0.25 left of job 1, alone again
    assert ps.advance(1.25) == [1]


def test_a_job_given_up_gives_its_share_back() -> None:
    ps = ProcessorSharing()
    ps.add(1, 1.0, 0.0)
    ps.add(2, 1.0, 0.0)
    ps.remove(2, 0.5)  # job 1 has 0.75 left, alone from now
    assert ps.next_end() == pytest.approx(1.25)
    ps.remove(3, 0.6)  # an unknown job: nothing changes
    assert ps.advance(1.25) == [1]


async def test_the_loop_ends_prefills_in_processor_sharing_order() -> None:
    compute = SharedCompute()
    ended: list[str] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def job(name: str, work_s: float, after_s: float = 0.0) -> None:
        await asyncio.sleep(after_s)
        await compute.run(work_s)
        ended.append(name)

    await asyncio.gather(job("long", 0.3), job("short", 0.05, after_s=0.05))
    assert ended == ["short", "long"]
    assert loop.time() - start >= 0.35 - 0.002  # all the work was done, one engine's worth


def test_a_start_or_a_leave_after_another_job_s_end_returns_that_job() -> None:
    ps = ProcessorSharing()
    ps.add(1, 1.0, 0.0)
    assert ps.add(2, 1.0, 1.5) == [1]  # job 1 ended at 1.0, before its timer was seen
    ps.add(3, 0.5, 1.5)
    assert ps.remove(2, 3.0) == [3]  # job 3 ended at 2.5 (each at half speed from 1.5)
    assert len(ps) == 0


async def test_a_prefill_whose_timer_is_late_still_ends() -> None:
    # The loop is busy past the first prefill's end, and the next prefill starts before the
    # timer's callback runs: the first one is done in that start's bookkeeping, and must be
    # woken there (it once was dropped from the bookkeeping and left waiting for ever).
    compute = SharedCompute()
    first = asyncio.create_task(compute.run(0.005))
    await asyncio.sleep(0)  # the first prefill starts, its timer set 5 ms ahead
    time.sleep(0.02)  # noqa: ASYNC251 -- on purpose: the loop is held past that end
    second = asyncio.create_task(compute.run(0.005))
    await asyncio.wait_for(first, 2.0)
    await asyncio.wait_for(second, 2.0)


async def test_a_cancelled_prefill_leaves_the_others_running() -> None:
    compute = SharedCompute()
    gone = asyncio.create_task(compute.run(10.0))
    await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.wait_for(compute.run(0.02), timeout=5.0)  # not held behind the 10 s


async def test_a_shared_engine_answers_two_prompts_together_no_faster_than_its_compute() -> None:
    costs = SimCosts(prefill_us_per_token=1000.0, prefill_us_per_cached_token=0.0,
                     decode_ms_per_token=0.0, prefill_shared=True)
    engine = SimEngine(PrefixCache(64, 16), max_running=4, costs=costs)
    loop = asyncio.get_running_loop()

    async def answer(rid: str, first: int) -> float:
        request = GenerationRequest(rid, list(range(first, first + 100)), 1, "")
        async with engine.admit(request) as generation:
            async for _ in generation.tokens():
                pass
        return loop.time()

    start = loop.time()
    ends = await asyncio.gather(answer("a", 0), answer("b", 1000))
    # 100 uncached tokens at 1 ms each, twice: 0.2 s of one engine, not 0.1 s each in parallel.
    assert min(ends) - start >= 0.2 - 0.002


def test_a_lower_priority_job_waits_while_a_better_one_is_in_prefill() -> None:
    """Lower values run first (vLLM's ``priority``): a job of priority 1 makes no progress
    while one of priority 0 is in prefill, then has the engine to itself."""
    ps = ProcessorSharing()
    ps.add(1, 1.0, 0.0, priority=1)  # alone until 0.25: 0.75 left
    ps.add(2, 0.5, 0.25)  # priority 0: the whole engine from 0.25 to 0.75
    assert ps.next_end() == pytest.approx(0.75)
    assert ps.advance(0.7) == []
    assert ps.advance(0.75) == [2]
    assert ps.next_end() == pytest.approx(1.5)  # job 1's 0.75 left, from 0.75
    assert ps.advance(1.5) == [1]


def test_one_step_past_the_better_class_hands_the_rest_of_the_time_on() -> None:
    """A late timer: the step covers the end of the class that ran and the time after it goes
    to the next class, as if the timer had fired at that end."""
    ps = ProcessorSharing()
    ps.add(1, 0.5, 0.0)
    ps.add(2, 0.5, 0.0)  # both priority 0: each ends at 1.0
    ps.add(3, 1.0, 0.0, priority=2)
    assert sorted(ps.advance(1.5)) == [1, 2]  # job 3 ran alone from 1.0: 0.5 left
    assert ps.next_end() == pytest.approx(2.0)
    ps.add(4, 0.25, 1.5, priority=1)  # a better class than job 3: it waits again
    assert ps.next_end() == pytest.approx(1.75)
    assert ps.advance(2.25) == [4, 3]  # 4 by 1.75, then 3's 0.5 left by 2.25


def test_a_better_job_given_up_lets_the_waiting_class_run() -> None:
    ps = ProcessorSharing()
    ps.add(1, 1.0, 0.0)
    ps.add(2, 1.0, 0.0, priority=5)
    ps.remove(1, 0.5)
    assert ps.next_end() == pytest.approx(1.5)  # job 2 untouched until 0.5, alone since
    assert ps.advance(1.5) == [2]
    assert len(ps) == 0


async def test_the_loop_runs_a_background_prefill_after_the_foreground_ones() -> None:
    compute = SharedCompute()
    ended: list[str] = []

    async def job(name: str, work_s: float, priority: int, after_s: float = 0.0) -> None:
        await asyncio.sleep(after_s)
        await compute.run(work_s, priority)
        ended.append(name)

    # The background job starts first and is shorter, and still ends last.
    await asyncio.gather(job("background", 0.05, 1), job("foreground", 0.1, 0, after_s=0.02))
    assert ended == ["foreground", "background"]


def test_a_job_begins_when_its_class_runs() -> None:
    """``begun`` reports each job once, when it first progresses: at once in the best class,
    after the better class is done otherwise."""
    ps = ProcessorSharing()
    ps.add(1, 0.5, 0.0)
    assert ps.begun() == [1]
    ps.add(2, 1.0, 0.0, priority=1)
    ps.add(3, 0.5, 0.1)
    assert ps.begun() == [3]
    assert ps.advance(0.7) == []  # 1 and 3 share: 1 has 0.5 - 0.1 - 0.3 left
    assert ps.begun() == []
    assert sorted(ps.advance(1.0)) == [1, 3]
    assert ps.begun() == [2]
    assert ps.begun() == []


async def test_the_loop_tells_a_background_prefill_when_it_begins() -> None:
    compute = SharedCompute()
    loop = asyncio.get_running_loop()
    at: dict[str, float] = {}

    async def job(name: str, work_s: float, priority: int, after_s: float = 0.0) -> None:
        await asyncio.sleep(after_s)
        def begun() -> None:
            at.setdefault(f"{name} begins", loop.time())

        await compute.run(work_s, priority, begun=begun)
        at[f"{name} ends"] = loop.time()

    start = loop.time()
    await asyncio.gather(job("foreground", 0.05, 0), job("background", 0.02, 1, after_s=0.01))
    assert at["foreground begins"] == pytest.approx(start, abs=0.005)
    # The background job, sent at 0.01 s, begins when the foreground one is done (0.05 s).
    assert at["background begins"] - start >= 0.05 - 0.002
    assert at["background begins"] <= at["foreground ends"] + 0.002
    assert at["background ends"] - at["background begins"] >= 0.02 - 0.002
