"""The record a worker registers in the metadata store: where it is and what it can hold."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker as it registers itself: where it is and what it can hold."""

    id: str
    url: str
    models: tuple[str, ...] = ()
    capacity_blocks: int = 0  # KV blocks of ``block_size`` tokens; 0 = unknown
    block_size: int = 16
    kind: str = "openai"  # which backend speaks to it
    # Where its engine publishes KV-cache events (vLLM's ZMQ format) and replays missed ones;
    # "" = it publishes none (see gateway.kvevents).
    kv_events: str = ""
    kv_replay: str = ""
    # Data-parallel engine ranks behind ``url`` (vLLM's --data-parallel-size), each routed to
    # as a worker of its own; KV events above are rank 0's, rank r's at each port + r.
    dp_size: int = 1
    # HMAC of the other fields under the registration secret ("" = unsigned); see
    # gateway.contracts.registry_signing.
    signature: str = ""

    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size
