"""The gateway's error family.

Handlers and backends raise a :class:`GatewayError`; one middleware (``gateway.app``) renders it
as the OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}``. Routing code never
builds HTTP responses: it returns a decision or raises :class:`NoWorkerAvailable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.contracts.errors import openai_error


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI-shaped body."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return openai_error(self.message, self.type, code=self.code, param=self.param)


class InvalidRequest(GatewayError):
    """The client sent something we cannot serve (400)."""

    status = 400
    type = "invalid_request_error"


class NotFound(GatewayError):
    """Unknown route or model (404)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class NoWorkerAvailable(GatewayError):
    """No healthy worker can take the request right now (503, retry later)."""

    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class RequestTimeout(GatewayError):
    """The client did not send its request body in time (408; the connection is closed)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class ConnectionQueueFull(GatewayError):
    """No connection to a worker became free in time (503, retry later)."""

    status = 503
    type = "service_unavailable"
    code = "connection_queue_timeout"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class UpstreamError(GatewayError):
    """Every candidate worker failed for a request we accepted (502)."""

    status = 502
    type = "upstream_error"
    code = "worker_failed"
