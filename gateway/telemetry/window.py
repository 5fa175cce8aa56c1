"""The last minutes of traffic in fixed time buckets, for the status page's charts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

_LATENCY_SAMPLES = 512  # per bucket; enough for a p95 a person reads off a chart


@dataclass(slots=True)
class _Bucket:
    start: float
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    misses: int = 0
    latencies: list[float] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class RecentWindow:
    """Requests, hit rate, latency and decisions per ``bucket_s`` over ``buckets`` buckets."""

    def __init__(self, bucket_s: float = 10.0, buckets: int = 60) -> None:
        if bucket_s <= 0 or buckets < 1:
            raise ValueError("bucket_s and buckets must be positive")
        self.bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque(maxlen=buckets)

    def _bucket(self, now: float) -> _Bucket:
        start = now - now % self.bucket_s
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start))
        return self._buckets[-1]

    def add(
        self,
        now: float,
        *,
        latency_s: float,
        error: bool,
        kind: str,
        input_tokens: int,
        cached_tokens: int,
        miss: bool,
    ) -> None:
        b = self._bucket(now)
        b.requests += 1
        b.errors += error
        b.input_tokens += input_tokens
        b.cached_tokens += cached_tokens
        b.misses += miss
        if len(b.latencies) < _LATENCY_SAMPLES:
            b.latencies.append(latency_s)
        if kind:
            b.decisions[kind] = b.decisions.get(kind, 0) + 1

    def series(self, now: float) -> list[dict[str, object]]:
        """One point per bucket over the window ending now, oldest first (empty buckets too)."""
        by_start = {b.start: b for b in self._buckets}
        last = now - now % self.bucket_s
        points: list[dict[str, object]] = []
        count = self._buckets.maxlen or 1
        for i in range(count - 1, -1, -1):
            start = last - i * self.bucket_s
            b = by_start.get(start) or _Bucket(start)
            lat = sorted(b.latencies)
            points.append({
                "t": start,
                "requests": b.requests,
                "errors": b.errors,
                "misses": b.misses,
                "hit_rate": b.cached_tokens / b.input_tokens if b.input_tokens else None,
                "p50_ms": _quantile(lat, 0.5) * 1000 if lat else None,
                "p95_ms": _quantile(lat, 0.95) * 1000 if lat else None,
                "decisions": dict(b.decisions),
            })
        return points

    def decision_totals(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for b in self._buckets:
            for kind, n in b.decisions.items():
                totals[kind] = totals.get(kind, 0) + n
        return totals
