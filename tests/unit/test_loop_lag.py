"""The event loop's lag probe: a loop kept busy shows as lag, one timer runs per interval,
and nothing is observed once it stops."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.telemetry.loop_lag import LoopLag


async def test_a_loop_held_past_the_timer_is_observed_as_that_lag() -> None:
    seen: list[float] = []
    lag = LoopLag(seen.append, interval_s=0.05)
    lag.start()
    time.sleep(0.3)  # noqa: ASYNC251 (the loop held past the timer, due after 0.05 s)
    await asyncio.sleep(0.12)
    lag.stop()
    assert seen
    assert max(seen) >= 0.2
    assert min(seen) >= 0.0


async def test_one_timer_per_interval_and_nothing_after_stop() -> None:
    seen: list[float] = []
    three = asyncio.Event()

    def observe(value: float) -> None:
        seen.append(value)
        if len(seen) >= 3:
            three.set()

    loop = asyncio.get_running_loop()
    lag = LoopLag(observe, interval_s=0.02)
    started = loop.time()
    lag.start()
    lag.start()  # a second start arms no second timer
    await asyncio.wait_for(three.wait(), 5.0)
    elapsed = loop.time() - started
    lag.stop()
    assert len(seen) <= elapsed / 0.02 + 1  # one observation per interval at most
    count = len(seen)
    await asyncio.sleep(0.08)
    assert len(seen) == count


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(lambda _: None, interval_s=0)
