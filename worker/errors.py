"""OpenAI-shaped API errors and the one middleware that renders them.

Handlers raise :class:`ApiError`; :func:`error_middleware` turns it (and aiohttp's own HTTP errors
such as 404 for an unknown path or 405) into ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.contracts.errors import openai_error

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, Any]:
        return openai_error(self.message, self.type, code=self.code, param=self.param)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


_HTTP_CODES = MappingProxyType(
    {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(
            exc.reason if exc.status != 404 else f"no route for {request.method} {request.path}",
            status=exc.status,
            code=_HTTP_CODES.get(exc.status, "http_error"),
            type_="invalid_request_error" if exc.status < 500 else "server_error",
        ).response()
    except Exception:
        # A bug, not bad input: log it and still answer in the OpenAI shape.
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(
            "internal server error", status=500, code="internal_error", type_="server_error"
        ).response()
