"""Where a worker publishes KV events: from its registry record or its ``--worker`` URL.

A static worker announces its endpoints in the URL's fragment, which is never sent to it::

    --worker 'http://10.0.0.5:8000#kv-events=tcp://10.0.0.5:5557&kv-replay=tcp://10.0.0.5:5558'

(vLLM: ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``). A registered worker puts
them in its record (``kv_events``, ``kv_replay``).

The fragment also says how many data-parallel engine ranks serve behind the URL
(``dp-size=N``); their endpoints are rank 0's, each port plus the rank, as vLLM binds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    """Where a worker publishes its KV events, and where it replays missed ones ("" = none)."""

    events: str
    replay: str = ""

    def for_rank(self, rank: int) -> EventEndpoints:
        """Where data-parallel rank ``rank`` of the engine publishes, when these are rank 0's:
        as vLLM's publisher binds them, each TCP port plus the rank, an ``ipc://`` path with
        ``_dp<rank>`` appended."""
        if rank == 0:
            return self
        return EventEndpoints(_offset(self.events, rank), _offset(self.replay, rank))

    def ranks(self, size: int) -> list[EventEndpoints]:
        """Each of ``size`` ranks' endpoints (:meth:`for_rank`). Raises ValueError when two
        ranks' would be one (events and replay ports closer than ``size``: rank 1's events
        would be rank 0's replay)."""
        out = [self.for_rank(r) for r in range(size)]
        bound = [e for pair in out for e in (pair.events, pair.replay) if e]
        if len(set(bound)) < len(bound):
            raise ValueError(
                f"with {size} data-parallel ranks the KV-event endpoints {self.events!r} and "
                f"{self.replay!r} overlap (each rank adds its rank to both ports): leave "
                f"{size} ports between them")
        return out


def _offset(endpoint: str, rank: int) -> str:
    if not endpoint:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    offset = int(port) + rank
    if offset > 65_535:
        raise ValueError(f"KV-event endpoint {endpoint!r} has no port for rank {rank}")
    return f"{base}:{offset}"


_SCHEMES = ("tcp://", "ipc://")


def split_url(url: str) -> tuple[str, EventEndpoints | None]:
    """``url`` without its fragment, and the event endpoints the fragment names (if any).
    Raises ValueError for a fragment that names something else or a malformed endpoint."""
    base, sep, fragment = url.partition("#")
    if not sep:
        return url, None
    options = _options(url, fragment)
    events, replay = options.get("kv-events", ""), options.get("kv-replay", "")
    for endpoint in (events, replay):
        if endpoint and not endpoint.startswith(_SCHEMES):
            raise ValueError(f"KV-event endpoint must be tcp:// or ipc://, got {endpoint!r}")
        if endpoint.startswith("tcp://") and not endpoint.rpartition(":")[2].isdigit():
            raise ValueError(f"KV-event endpoint {endpoint!r} names no port")
    if replay and not events:
        raise ValueError(f"kv-replay needs kv-events in {url!r}")
    return base, EventEndpoints(events, replay) if events else None


MAX_DP_SIZE = 256


def data_parallel_size(url: str) -> int:
    """The engine ranks behind a worker URL: ``#dp-size=N`` (vLLM's ``--data-parallel-size``
    with one API server), each routed to as a worker of its own; 1 without the option. Raises
    ValueError for a size that is not an integer from 1 to :data:`MAX_DP_SIZE`."""
    _, sep, fragment = url.partition("#")
    text = _options(url, fragment).get("dp-size", "1") if sep else "1"
    if not text.isdigit() or not 1 <= int(text) <= MAX_DP_SIZE:
        raise ValueError(f"dp-size must be an integer from 1 to {MAX_DP_SIZE}, got {text!r} "
                         f"in {url!r}")
    return int(text)


def _options(url: str, fragment: str) -> dict[str, str]:
    options = dict(parse_qsl(fragment, keep_blank_values=True))
    unknown = set(options) - {"kv-events", "kv-replay", "dp-size"}
    if unknown:
        raise ValueError(f"unknown worker URL option(s) {sorted(unknown)} in {url!r}; "
                         "known: kv-events, kv-replay, dp-size")
    return options
