"""What /metrics says of each worker's modelled cache, read from the pool at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.telemetry.metrics import GatewayMetrics


def _samples(metrics: GatewayMetrics) -> dict[str, float]:
    lines = generate_latest(metrics.registry).decode().splitlines()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in lines if line and not line.startswith("#"))}


def test_the_modelled_cache_and_its_size_per_worker_and_the_index_size() -> None:
    index = PrefixIndex()
    pool = WorkerPool(["http://a:1", "http://b:1"], index)
    a, b = (s.worker.id for s in pool.states())
    metrics = GatewayMetrics(pool)
    samples = _samples(metrics)
    assert samples[f'gateway_worker_modelled_cache_blocks{{worker="{a}"}}'] == 0.0
    assert f'gateway_worker_cache_capacity_blocks{{worker="{a}"}}' not in samples  # unknown
    assert samples["gateway_prefix_index_checkpoints"] == 0.0
    pool.set_capacity(a, 4)
    index.record([1, 2, 3], a, 0.0)
    index.record([1, 2], b, 0.0)
    index.record([7, 8, 9], a, 1.0)  # 6 blocks into 4: the least recently used evicted
    samples = _samples(metrics)
    assert samples[f'gateway_worker_cache_capacity_blocks{{worker="{a}"}}'] == 4.0
    assert samples[f'gateway_worker_modelled_cache_blocks{{worker="{a}"}}'] == 4.0
    assert samples[f'gateway_worker_modelled_cache_blocks{{worker="{b}"}}'] == 2.0
    assert samples["gateway_prefix_index_checkpoints"] == 5.0  # 1, 2 (b's too), 7, 8, 9
