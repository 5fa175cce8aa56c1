"""The first-byte guard and the connection slots, on a real event loop."""

from __future__ import annotations

import asyncio

import pytest

from gateway.guard import (
    ConnectionSlots,
    FirstByteWaits,
    IdleTimer,
    NoFirstByte,
    SlotTimeout,
)


async def _hang(cancelled: list[bool]) -> str:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
    return "never"


async def _answer() -> str:
    await asyncio.sleep(0)
    return "reply"


async def test_a_reply_in_time_is_returned() -> None:
    assert await FirstByteWaits(1.0).wait(_answer(), "w1") == "reply"


async def test_a_silent_worker_is_given_up_at_the_timeout_and_its_request_cancelled() -> None:
    cancelled: list[bool] = []
    with pytest.raises(NoFirstByte, match="first-byte timeout"):
        await FirstByteWaits(0.05).wait(_hang(cancelled), "w1")
    assert cancelled == [True]
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # the cancel request that gave it up is withdrawn


async def test_an_ejection_gives_up_at_once_even_without_a_timeout() -> None:
    waits, cancelled = FirstByteWaits(0), list[bool]()
    asyncio.get_running_loop().call_later(0.05, waits.eject, "w1", "probe failed")
    with pytest.raises(NoFirstByte, match="found down while waiting: probe failed"):
        await waits.wait(_hang(cancelled), "w1")
    assert cancelled == [True]


async def test_another_workers_ejection_does_not_touch_the_wait() -> None:
    waits = FirstByteWaits(0)

    async def slow() -> str:
        await asyncio.sleep(0.1)
        return "reply"

    asyncio.get_running_loop().call_later(0.02, waits.eject, "w2", "down")
    assert await waits.wait(slow(), "w1") == "reply"


async def test_the_openings_own_timeout_is_not_taken_for_ours() -> None:
    async def times_out() -> str:
        raise TimeoutError("connect timeout")

    with pytest.raises(TimeoutError, match="connect timeout"):
        await FirstByteWaits(5.0).wait(times_out(), "w1")


async def test_an_ejection_after_the_reply_is_harmless() -> None:
    waits = FirstByteWaits(1.0)
    assert await waits.wait(_answer(), "w1") == "reply"
    waits.eject("w1", "late")  # nobody waits any more: nothing to give up, nothing raised


async def test_many_waits_under_one_timer_each_keep_their_own_deadline() -> None:
    # Waits begun 0.04 s apart under a 0.1 s timeout: the one timer, armed for the first
    # deadline, gives up each wait at its own, while replies in time go through.
    waits = FirstByteWaits(0.1)
    loop = asyncio.get_running_loop()
    ends: dict[str, tuple[str, float]] = {}

    async def attempt(name: str, reply_after: float | None) -> None:
        async def opening() -> str:
            if reply_after is None:
                await asyncio.Event().wait()
            await asyncio.sleep(reply_after or 0)
            return "reply"

        started = loop.time()
        try:
            ends[name] = (await waits.wait(opening(), name), loop.time() - started)
        except NoFirstByte:
            ends[name] = ("given up", loop.time() - started)

    tasks = []
    for name, reply_after in (("a", None), ("b", 0.02), ("c", None), ("d", None)):
        tasks.append(asyncio.ensure_future(attempt(name, reply_after)))
        await asyncio.sleep(0.04)
    await asyncio.gather(*tasks)
    assert {n: what for n, (what, _) in ends.items()} == {
        "a": "given up", "b": "reply", "c": "given up", "d": "given up"}
    assert all(took >= 0.09 for what, took in ends.values() if what == "given up")


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    # The client went away while the attempt waited: that cancel is not a first-byte failure,
    # even when the timeout gave the wait up in the same turn of the loop.
    waits = FirstByteWaits(0.05)
    cancelled: list[bool] = []
    task = asyncio.ensure_future(waits.wait(_hang(cancelled), "w1"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == [True]
    outside = asyncio.ensure_future(waits.wait(_hang([]), "w1"))
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_later(0.05, outside.cancel)  # with the timer, same turn
    with pytest.raises((asyncio.CancelledError, NoFirstByte)):
        await outside


async def test_an_opening_that_answers_a_give_up_still_returns_and_withdraws_it() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "answered anyway"
        return "never"

    waits = FirstByteWaits(0.02)
    assert await waits.wait(stubborn(), "w1") == "answered anyway"
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_slots_queue_then_time_out_and_release_once() -> None:
    slots = ConnectionSlots(total=4, per_worker=1, queue_timeout_s=0.05)
    release = await slots.take("w1")
    with pytest.raises(SlotTimeout) as caught:
        await slots.take("w1")
    assert caught.value.scope == "w1"
    release()
    release()  # a second call changes nothing
    again = await slots.take("w1")
    with pytest.raises(SlotTimeout):
        await slots.take("w1")
    again()


async def test_slots_go_to_waiters_first_come_first_served() -> None:
    slots = ConnectionSlots(total=1, per_worker=1, queue_timeout_s=5.0)
    release = await slots.take("w1")
    order: list[str] = []

    async def wait_for(name: str, wid: str) -> None:
        done = await slots.take(wid)
        order.append(name)
        done()

    first = asyncio.create_task(wait_for("first", "w1"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait_for("second", "w2"))  # in line for the total behind it
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(wait_for("cancelled", "w1"))
    await asyncio.sleep(0)
    cancelled.cancel()  # leaving the line hands nothing away and takes nothing
    release()
    await asyncio.gather(first, second)
    assert order == ["first", "second"]
    assert cancelled.cancelled()
    again = await slots.take("w1")  # every place came back
    again()


async def test_a_free_slot_is_taken_without_waiting_and_a_busy_one_is_not() -> None:
    slots = ConnectionSlots(total=2, per_worker=1, queue_timeout_s=5.0)
    first = slots.try_take("w1")
    assert first is not None
    assert slots.try_take("w1") is None  # the worker's one place is taken
    other = slots.try_take("w2")
    assert other is not None
    assert slots.try_take("w3") is None  # both places of the total are taken
    first()
    first()  # a second call gives back nothing more
    third = slots.try_take("w3")
    assert third is not None  # the total's place came back, w3's own was free
    assert slots.try_take("w1") is None  # and the total is full again
    other()
    third()

    # A waiter in line keeps its turn: a place given back goes to it, not to a try.
    held = await slots.take("w1")
    waiting = asyncio.create_task(slots.take("w1"))
    await asyncio.sleep(0)
    held()
    assert slots.try_take("w1") is None
    (await waiting)()


async def _chunks(timer: IdleTimer, gaps: list[float], write_s: float = 0.0) -> int:
    """Waits ``gaps`` seconds for each chunk under ``timer``, spending ``write_s`` between
    chunks outside the waits (a slow client); returns the chunks received."""
    got = 0
    try:
        for gap in gaps:
            timer.wait()
            await asyncio.sleep(gap)
            timer.heard()
            got += 1
            await asyncio.sleep(write_s)
    finally:
        timer.close()
    return got


async def test_idle_timer_ends_a_wait_past_its_limit() -> None:
    timer = IdleTimer(0.05)
    with pytest.raises(asyncio.CancelledError):
        await _chunks(timer, [0.01, 0.01, 1.0])
    assert timer.timed_out()


async def test_idle_timer_spares_a_stream_whose_waits_are_short_however_long_it_runs() -> None:
    # 12 waits of 0.02 s under a 0.05 s limit: the one timer fires mid-stream and re-arms.
    assert await _chunks(IdleTimer(0.05), [0.02] * 12) == 12


async def test_idle_timer_does_not_count_the_time_spent_writing_to_the_client() -> None:
    assert await _chunks(IdleTimer(0.05), [0.01] * 4, write_s=0.08) == 4


async def test_idle_timer_closed_cancels_nothing_later() -> None:
    timer = IdleTimer(0.02)
    timer.wait()
    timer.close()
    await asyncio.sleep(0.06)  # past the deadline: the task must not be cancelled
    assert not timer.expired


async def test_a_cancellation_from_elsewhere_is_not_the_idle_timers() -> None:
    async def stream() -> None:
        timer = IdleTimer(0.05)
        try:
            await _chunks(timer, [1.0])
        except asyncio.CancelledError:
            assert not timer.timed_out()
            raise

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
