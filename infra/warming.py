"""Follow the warm-up of workers that just joined, as a gateway reports it.

``infra local scale N --gateway URL`` and ``infra sagemaker scale ... --gateway URL`` call
:func:`follow` after adding capacity: it polls the gateway's ``/admin/workers`` and prints one
line whenever a new worker's state changes (seen by the gateway, warming with prompts replayed
out of planned, ramping its weight, serving), until every one of them serves or the time is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import aiohttp


def describe(worker: Mapping[str, Any] | None) -> str:
    """One line for a worker entry of ``/admin/workers`` (None: the gateway has not seen it)."""
    if worker is None:
        return "not seen by the gateway yet"
    if not worker.get("healthy"):
        return f"down ({worker.get('last_error') or 'not probed yet'})"
    warmup = worker.get("warmup")
    if not warmup or not warmup.get("warming"):
        if warmup and warmup.get("phase") == "ready":
            return (f"serving (warmed {warmup['done_prompts']}/{warmup['planned_prompts']} "
                    f"prompts, {warmup['done_blocks']} blocks)")
        return "serving"
    phase = warmup["phase"]
    if phase == "ramping":
        return f"ramping its weight ({warmup['ramp']:.2f} of full)"
    return (f"{phase}: {warmup['done_prompts']}/{warmup['planned_prompts']} prompts, "
            f"{warmup['done_blocks']}/{warmup['planned_blocks']} blocks"
            + (f", {warmup['failed_prompts']} failed" if warmup["failed_prompts"] else ""))


def settled(worker: Mapping[str, Any] | None) -> bool:
    if worker is None or not worker.get("healthy"):
        return False
    warmup = worker.get("warmup")
    return not warmup or not warmup.get("warming")


async def follow(
    gateway: str,
    worker_ids: Collection[str],
    *,
    timeout_s: float = 120.0,
    interval_s: float = 0.5,
    token: str = "",
    out: Callable[[str], None] = print,
) -> bool:
    """Print the warm-up progress of ``worker_ids``; True when all of them serve in time."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    last: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
        while True:
            view: dict[str, Any] = {}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(gateway.rstrip("/") + "/admin/workers") as r:
                    if r.status == 200:
                        view = await r.json()
                    else:
                        out(f"gateway {gateway}: /admin/workers answered {r.status}")
                        return False
            workers = {w["id"]: w for w in view.get("workers", [])}
            for wid in worker_ids:
                line = describe(workers.get(wid))
                if last.get(wid) != line:
                    last[wid] = line
                    out(f"{wid}: {line}")
            if view and all(settled(workers.get(wid)) for wid in worker_ids):
                return True
            if time.monotonic() > deadline:
                out(f"gave up after {timeout_s:.0f}s; the gateway keeps warming in the background")
                return False
            await asyncio.sleep(interval_s)
