"""What a backend kind declares about itself: the URL schemes it serves, how a worker URL of
those schemes becomes a worker id and a target URL, and how to build the backend.

Each backend module declares its kind(s); :mod:`gateway.backends.registry` lists them, and the
pool, the credentials, the registry trust and the application ask the registry instead of
testing kind names or URL prefixes themselves.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.backends.base import Backend


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What every backend is built from (the gateway's settings, resolved)."""

    connect_timeout_s: float
    read_timeout_s: float
    max_connections: int
    max_connections_per_worker: int
    warm_connections: int = 0  # relay connections kept open to each healthy worker
    api_keys: Mapping[str, str] = field(default_factory=dict)  # worker id -> key it expects
    default_api_key: str = ""
    admin_token: str = ""
    # TLS to https:// workers (a private CA, a client certificate); None: the system's defaults.
    ssl_context: ssl.SSLContext | None = None


@dataclass(frozen=True, slots=True)
class BackendKind:
    name: str  # the worker's ``kind`` (``Worker.kind``, ``WorkerRecord.kind``)
    schemes: tuple[str, ...]  # worker URL schemes it serves (``http``, ``sagemaker``, ...)
    worker_id: Callable[[str], str]  # stable, readable id of a worker URL; ValueError if bad
    target_url: Callable[[str], str]  # where requests go (without credentials or markers)
    build: Callable[[BackendOptions], Backend]
    # The URL's query names the worker's credentials (see gateway.credentials).
    query_names_credentials: bool = True
    # Its probe cannot confirm a registered cache size; the claim is believed, capped (see
    # gateway.registry_trust).
    trust_unconfirmed_capacity: bool = False
    # It can pin a request to one data-parallel engine rank behind the URL (``#dp-size=N``).
    data_parallel_ranks: bool = False
