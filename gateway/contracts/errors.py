"""The OpenAI error body, as the gateway, its backends and the reference worker all answer it.

``{"error": {"message", "type", "param", "code"}}``: what the openai client parses into its
``APIError`` (``message``, ``type``, ``param``, ``code``), in a JSON response or an SSE event.
"""

from __future__ import annotations

from typing import Any


def openai_error(message: str, type_: str, *, code: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    """The error body for ``message`` (``type_``: ``invalid_request_error``, ``server_error``,
    ``rate_limit_error``, ``upstream_error``, ...)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
