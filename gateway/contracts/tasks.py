"""Background loops that stop when asked, even when a library swallowed the cancellation.

On Python 3.11 a ``CancelledError`` delivered while a client library waits inside
``asyncio.wait_for`` (redis-py does, for its socket timeouts) can come out as a timeout or a
connection error; a loop that logs errors and sleeps again would then never end, and the
application's shutdown would wait for it forever. Loops call :func:`stop_if_cancelled` after
handling an error. :func:`running` keeps one such loop going for the length of a block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` if the running task has been asked to stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@contextlib.asynccontextmanager
async def running(loop: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """``loop`` runs as a task while the block runs; on the way out it is cancelled and
    awaited (so nothing of it is left when the block ends)."""
    task = asyncio.create_task(loop, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
