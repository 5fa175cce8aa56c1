"""The first-byte guard and the connection slots, on a real event loop."""

from __future__ import annotations

import asyncio

import pytest

from gateway.guard import ConnectionSlots, Ejections, NoFirstByte, SlotTimeout, first_byte


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
    assert await first_byte(_answer(), 1.0, Ejections(), "w1") == "reply"


async def test_a_silent_worker_is_given_up_at_the_timeout_and_its_request_cancelled() -> None:
    cancelled: list[bool] = []
    with pytest.raises(NoFirstByte, match="first-byte timeout"):
        await first_byte(_hang(cancelled), 0.05, Ejections(), "w1")
    assert cancelled == [True]


async def test_an_ejection_gives_up_at_once_even_without_a_timeout() -> None:
    ejections, cancelled = Ejections(), list[bool]()
    asyncio.get_running_loop().call_later(0.05, ejections.eject, "w1", "probe failed")
    with pytest.raises(NoFirstByte, match="found down while waiting: probe failed"):
        await first_byte(_hang(cancelled), 0, ejections, "w1")
    assert cancelled == [True]


async def test_another_workers_ejection_does_not_touch_the_wait() -> None:
    ejections = Ejections()

    async def slow() -> str:
        await asyncio.sleep(0.1)
        return "reply"

    asyncio.get_running_loop().call_later(0.02, ejections.eject, "w2", "down")
    assert await first_byte(slow(), 0, ejections, "w1") == "reply"


async def test_the_openings_own_timeout_is_not_taken_for_ours() -> None:
    async def times_out() -> str:
        raise TimeoutError("connect timeout")

    with pytest.raises(TimeoutError, match="connect timeout"):
        await first_byte(times_out(), 5.0, Ejections(), "w1")


async def test_an_ejection_after_the_reply_is_harmless() -> None:
    ejections = Ejections()
    assert await first_byte(_answer(), 1.0, ejections, "w1") == "reply"
    ejections.eject("w1", "late")  # nobody waits any more: nothing to call, nothing raised


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
