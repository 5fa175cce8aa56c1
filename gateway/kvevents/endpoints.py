"""Where a worker publishes KV events: from its registry record or its ``--worker`` URL.

A static worker announces its endpoints in the URL's fragment, which is never sent to it::

    --worker 'http://10.0.0.5:8000#kv-events=tcp://10.0.0.5:5557&kv-replay=tcp://10.0.0.5:5558'

(vLLM: ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``). A registered worker puts
them in its record (``kv_events``, ``kv_replay``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    """Where a worker publishes its KV events, and where it replays missed ones ("" = none)."""

    events: str
    replay: str = ""


_SCHEMES = ("tcp://", "ipc://")


def split_url(url: str) -> tuple[str, EventEndpoints | None]:
    """``url`` without its fragment, and the event endpoints the fragment names (if any).
    Raises ValueError for a fragment that names something else or a malformed endpoint."""
    base, sep, fragment = url.partition("#")
    if not sep:
        return url, None
    options = dict(parse_qsl(fragment, keep_blank_values=True))
    unknown = set(options) - {"kv-events", "kv-replay"}
    if unknown:
        raise ValueError(f"unknown worker URL option(s) {sorted(unknown)} in {url!r}; "
                         "known: kv-events, kv-replay")
    events, replay = options.get("kv-events", ""), options.get("kv-replay", "")
    for endpoint in (events, replay):
        if endpoint and not endpoint.startswith(_SCHEMES):
            raise ValueError(f"KV-event endpoint must be tcp:// or ipc://, got {endpoint!r}")
    if replay and not events:
        raise ValueError(f"kv-replay needs kv-events in {url!r}")
    return base, EventEndpoints(events, replay) if events else None
