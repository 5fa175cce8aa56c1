"""Signed worker registrations: Redis write access alone must not add a worker.

A worker started with a registration secret signs its registry record (HMAC-SHA256 over every
field a gateway acts on: id, URL, backend kind, models, cache size, KV-event endpoints,
data-parallel ranks); a gateway with the same secret ignores records whose signature is missing
or wrong. Without it,
anyone who can write to the store could register a server of their own and receive a share of
the prompts (probe confirmation and weight caps bound the share, not the capture).

A copied record still verifies, but it names the real worker's URL, so replaying it only
re-announces that worker (which the health probes still have to find alive).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from pathlib import Path

from gateway.contracts.worker_record import WorkerRecord

_CONTEXT = b"affinity-worker-record/v1\n"


def load_secret(value: str, path: str) -> bytes:
    """The registration secret, given directly or as the first line of a file (the file wins);
    ValueError if the file cannot be read or is empty."""
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip().partition("\n")[0].strip()
        except OSError as exc:
            raise ValueError(f"cannot read the registration secret file {path!r}: "
                             f"{exc.strerror}") from exc
        if not value:
            raise ValueError(f"the registration secret file {path!r} is empty")
    return value.encode("utf-8")


def _message(record: WorkerRecord) -> bytes:
    fields = [
        record.id, record.url, record.kind, list(record.models), record.capacity_blocks,
        record.block_size, record.kv_events, record.kv_replay,
    ]
    if record.dp_size != 1:  # signed when it says something (records of one engine as before)
        fields.append(record.dp_size)
    return _CONTEXT + json.dumps(fields, separators=(",", ":")).encode("utf-8", "surrogatepass")


def signature(record: WorkerRecord, secret: bytes) -> str:
    return hmac.new(secret, _message(record), hashlib.sha256).hexdigest()


def signed(record: WorkerRecord, secret: bytes) -> WorkerRecord:
    """``record`` carrying its signature (unchanged without a secret)."""
    if not secret:
        return record
    return dataclasses.replace(record, signature=signature(record, secret))


def verified(record: WorkerRecord, secret: bytes) -> bool:
    """Whether ``record`` carries a valid signature under ``secret`` (always, without one)."""
    if not secret:
        return True
    return bool(record.signature) and hmac.compare_digest(
        record.signature, signature(record, secret)
    )
