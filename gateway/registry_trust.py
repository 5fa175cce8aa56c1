"""How much a registry entry is believed (pure; no I/O).

Anyone with write access to the store can register a worker and claim a huge KV cache; ring
weight follows cache size, so a believed claim would draw most cold traffic. Two rules stop
that: an HTTP worker's claim counts only up to what its own ``/metrics`` report when the gateway
probes it (``vllm:cache_config_info``; unconfirmed claims count as the default weight 1), and
no weight exceeds ``max_weight`` times the pool's median. SageMaker targets cannot be probed
for their cache; the gateway invokes them in its own AWS account, so their claims are capped
but not confirmed.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.backends.registry import kind_named
from gateway.store.base import WorkerRecord


def _trusted_unconfirmed(kind_name: str) -> bool:
    kind = kind_named(kind_name)
    return kind is not None and kind.trust_unconfirmed_capacity


@dataclass(frozen=True, slots=True)
class TrustedCapacity:
    weights: dict[str, float]  # ring weight per registered worker
    capacity_tokens: dict[str, float]  # believed KV cache size, for confirmed workers only


def trusted_capacities(
    records: Sequence[WorkerRecord], probed_tokens: Mapping[str, float], max_weight: float
) -> TrustedCapacity:
    """Ring weights and believed cache sizes of ``records``, given each worker's probed cache
    size in tokens (absent or 0: its probe did not tell)."""
    believed: dict[str, float] = {}
    for record in records:
        claimed = float(record.capacity_tokens())
        probed = probed_tokens.get(record.id, 0.0)
        if claimed <= 0:
            continue
        if probed > 0:
            believed[record.id] = min(claimed, probed)
        elif _trusted_unconfirmed(record.kind):
            believed[record.id] = claimed
    weights = {r.id: 1.0 for r in records}
    if believed:
        median = statistics.median(believed.values())
        for wid, tokens in believed.items():
            weights[wid] = min(max(tokens / median, 1.0 / max_weight), max_weight)
    return TrustedCapacity(weights, believed)
