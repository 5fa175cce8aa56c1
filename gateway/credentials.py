"""Credentials the gateway presents to workers (e.g. a vLLM started with ``--api-key``).

A worker URL may name its key: ``vllm+http://host:8000?api_key_env=VLLM_KEY`` (read from that
environment variable) or ``?api_key_file=/run/secrets/vllm`` (first line of the file). Workers
without one (and workers that register themselves in the store) get ``--worker-api-key``. Keys
are read once at startup and never shown: worker URLs lose their query before they are used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qs, urlsplit

from gateway.auth import read_secret
from gateway.backends.registry import kind_of_url
from gateway.pool import worker_id_for


def worker_key(url: str, environ: Mapping[str, str] | None = None) -> str:
    """The key named by one worker URL's query; "" when it names none."""
    if not kind_of_url(url).query_names_credentials or "?" not in url:
        return ""
    query = parse_qs(urlsplit(url).query)
    env_names, files = query.get("api_key_env", []), query.get("api_key_file", [])
    unknown = set(query) - {"api_key_env", "api_key_file"}
    if unknown or len(env_names) + len(files) > 1:
        raise ValueError("a worker URL's query takes one of api_key_env=NAME or "
                         f"api_key_file=PATH, got: {', '.join(sorted(query))}")
    env = os.environ if environ is None else environ
    if env_names:
        value = env.get(env_names[0], "").strip()
        if not value:
            raise ValueError(f"the environment variable {env_names[0]} (a worker's API key) is "
                             "not set")
        return value
    return read_secret("", files[0], "worker API key")


def worker_keys(
    urls: Iterable[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Worker id -> API key, for the URLs that name one."""
    keys: dict[str, str] = {}
    for url in urls:
        key = worker_key(url, environ)
        if key:
            keys[worker_id_for(url)] = key
    return keys
