"""One line per request: JSON (default) or ``key=value`` text, on the ``gateway.access`` logger.

Fields: time, request id, method, path, status, tenant (a hash of the API key, never the key),
model, policy, decision kind, worker, attempts, predicted/cached/input tokens, miss cause,
latency and time to first token in milliseconds, bytes sent, error code. Never prompt or
completion text. Health checks, scrapes and the status page's polling are not logged unless
they fail.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.telemetry.record import RequestRecord

ACCESS_LOG_MODES = ("json", "text", "off")
LOGGER_NAME = "gateway.access"
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics", "/favicon.ico"})
QUIET_PREFIXES = ("/ui",)


def configure_stream(stream: object = None) -> None:
    """Send access lines bare (the line is the message) to stdout, apart from other logs."""
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(stream or sys.stdout)  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def fields(record: RequestRecord, latency_s: float, sent_bytes: int) -> dict[str, object]:
    out: dict[str, object] = {
        "ts": round(time.time(), 3),
        "request_id": record.request_id,
        "method": record.method,
        "path": record.path,
        "status": record.status,
        "latency_ms": round(latency_s * 1000, 3),
        "bytes": sent_bytes,
    }
    if record.model:
        out.update(tenant=record.tenant[:16], model=record.model, stream=record.stream)
    if record.worker:
        out.update(policy=record.policy, decision=record.kind, worker=record.worker,
                   attempts=record.attempts, predicted_blocks=record.match_blocks)
    elif record.attempts:
        out["attempts"] = record.attempts
    if record.input_tokens is not None:
        out.update(input_tokens=record.input_tokens, cached_tokens=record.cached_tokens)
    if record.ttft_s is not None:
        out["ttft_ms"] = round(record.ttft_s * 1000, 3)
    if record.miss_cause:
        out["miss"] = record.miss_cause
    if record.error_code:
        out["error"] = record.error_code
    return out


class AccessLog:
    def __init__(self, mode: str = "json") -> None:
        if mode not in ACCESS_LOG_MODES:
            raise ValueError(f"access log must be one of {', '.join(ACCESS_LOG_MODES)}")
        self.mode = mode
        self._logger = logging.getLogger(LOGGER_NAME)

    def write(self, record: RequestRecord, latency_s: float, sent_bytes: int) -> None:
        if self.mode == "off" or not self._logger.isEnabledFor(logging.INFO):
            return
        quiet = record.path in QUIET_PATHS or record.path.startswith(QUIET_PREFIXES)
        if quiet and record.status < 400:
            return
        values = fields(record, latency_s, sent_bytes)
        if self.mode == "json":
            line = json.dumps(values, separators=(",", ":"))
        else:
            line = " ".join(f"{k}={v}" for k, v in values.items())
        self._logger.info(line)
