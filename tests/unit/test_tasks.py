"""A loop stops when cancelled even if a library swallowed the CancelledError."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.contracts.tasks import stop_if_cancelled


async def _swallowing_step() -> None:
    """What a client library can do on 3.11: the cancel comes out as an ordinary error."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        raise ConnectionError("lost the connection") from None


async def _loop(check: bool, done: asyncio.Event) -> None:
    while not done.is_set():
        with contextlib.suppress(ConnectionError):
            await _swallowing_step()
        if check:
            stop_if_cancelled()
        await asyncio.sleep(0.01)


async def test_a_swallowed_cancel_still_stops_the_loop() -> None:
    done = asyncio.Event()
    checked = asyncio.create_task(_loop(True, done))
    unchecked = asyncio.create_task(_loop(False, done))
    await asyncio.sleep(0.01)
    checked.cancel()
    unchecked.cancel()
    ended, running = await asyncio.wait({checked, unchecked}, timeout=0.5)
    assert ended == {checked}
    assert checked.cancelled()
    assert running == {unchecked}  # without the check it runs on: what hung shutdowns
    done.set()  # how else it could be stopped
    unchecked.cancel()
    await asyncio.wait({unchecked}, timeout=1.0)
    assert unchecked.done()
