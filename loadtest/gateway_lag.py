"""Our gateway's event-loop lag over one run, from two reads of its ``/metrics``.

The gateway samples how late its event loop runs a timer due every 0.25 s
(``gateway_event_loop_lag_seconds``, :mod:`gateway.telemetry.loop_lag`). Read before and after
a run, the histogram's difference is the run's own samples: their mean lag and the share of
them over 10 ms. A lag of milliseconds says the gateway was short of CPU during the run (its
requests waited that long at each step), which a latency figure alone does not tell apart from
a slow worker.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import aiohttp

LAG = "gateway_event_loop_lag_seconds"
_WITHIN = f'{LAG}_bucket{{le="0.01"}}'


@dataclass(frozen=True, slots=True)
class LagReading:
    """The histogram's totals at one read: samples, their summed lag, those within 10 ms."""

    count: float
    total_s: float
    within_10ms: float


def parse(text: str) -> LagReading | None:
    """The lag histogram's totals in a Prometheus text page (None: not there)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(LAG):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    try:
        return LagReading(values[f"{LAG}_count"], values[f"{LAG}_sum"], values[_WITHIN])
    except KeyError:
        return None


async def read(session: aiohttp.ClientSession, url: str) -> LagReading | None:
    """One read of the gateway's ``/metrics`` (None if it cannot be read)."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        async with session.get(url + "/metrics") as response:
            if response.status == 200:
                return parse(await response.text())
    return None


def between(before: LagReading | None, after: LagReading | None
            ) -> tuple[float | None, float | None]:
    """The samples taken between two reads: their mean lag in ms and the share over 10 ms
    (None, None without two reads or without a sample between them)."""
    if before is None or after is None:
        return None, None
    count = after.count - before.count
    if count <= 0:
        return None, None
    mean_ms = (after.total_s - before.total_s) / count * 1e3
    over = 1.0 - (after.within_10ms - before.within_10ms) / count
    return mean_ms, over
