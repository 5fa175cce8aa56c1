"""One line per request: JSON (default) or ``key=value`` text, on the ``gateway.access`` logger.

Fields: time, request id, method, path, status, tenant (a hash of the API key, never the key),
model, policy, decision kind, worker, attempts, predicted/cached/input tokens, miss cause,
latency and time to first token in milliseconds, bytes sent, error code. Never prompt or
completion text. Health checks, scrapes and the status page's polling are not logged unless
they fail.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import IO, TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from gateway.telemetry.record import RequestRecord

ACCESS_LOG_MODES = ("json", "text", "off")
LOGGER_NAME = "gateway.access"
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics", "/favicon.ico"})
QUIET_PREFIXES = ("/ui",)


FLUSH_AFTER_S = 0.2  # the longest a line waits in the buffer while the event loop runs
FLUSH_LINES = 512


class BufferedLines(logging.Handler):
    """Writes the bare message of each record to ``stream``, in batches: one write per
    ``FLUSH_LINES`` lines or ``FLUSH_AFTER_S`` (a timer on the running event loop), not one
    write and flush per request. Without a running loop every line is written at once."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        self.stream = stream
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_line(record.getMessage())
        except Exception:
            self.handleError(record)

    def write_line(self, line: str) -> None:
        """What ``emit`` does with a record's message, without building the record."""
        self._lines.append(line)
        if len(self._lines) == 1:
            try:
                asyncio.get_running_loop().call_later(FLUSH_AFTER_S, self.flush)
                return
            except RuntimeError:
                pass
        if len(self._lines) >= FLUSH_LINES or len(self._lines) == 1:
            self.flush()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            if not self._lines:
                return
            lines, self._lines = self._lines, []
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass  # stdout closed or gone: access lines are best effort


def configure_stream(stream: IO[str] | None = None) -> None:
    """Send access lines bare (the line is the message) to stdout, apart from other logs."""
    logger = logging.getLogger(LOGGER_NAME)
    handler = BufferedLines(stream or sys.stdout)
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
        out["tenant"] = record.tenant[:16]
        out["model"] = record.model
        out["stream"] = record.stream
    if record.worker:
        out["policy"] = record.policy
        out["decision"] = record.kind
        out["worker"] = record.worker
        out["attempts"] = record.attempts
        out["predicted_blocks"] = record.match_blocks
    elif record.attempts:
        out["attempts"] = record.attempts
    if record.input_tokens is not None:
        out["input_tokens"] = record.input_tokens
        out["cached_tokens"] = record.cached_tokens
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
            line = orjson.dumps(values).decode()
        else:
            line = " ".join(f"{k}={v}" for k, v in values.items())
        handlers = self._logger.handlers
        if len(handlers) == 1 and type(handlers[0]) is BufferedLines and not self._logger.propagate:
            handlers[0].write_line(line)  # the stdout sink alone: skip building a LogRecord
        else:
            self._logger.info(line)
