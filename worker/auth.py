"""Access to the worker's API: ``--api-key`` for ``/v1/*``, ``--admin-token`` for ``/admin/*``.

With a key configured the worker serves only callers that hold it (the gateway), so the cache
namespace it takes from ``x-cache-namespace`` comes from the gateway, never from a client.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from worker.errors import ApiError


def _presented(request: web.Request) -> bytes:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    token = value.strip() if scheme.lower() == "bearer" else ""
    return token.encode("utf-8", "surrogatepass")


def _matches(request: web.Request, secret: str) -> bool:
    return hmac.compare_digest(_presented(request), secret.encode("utf-8"))


def auth_middleware(api_key: str, admin_token: str) -> Middleware:
    """A middleware that enforces the configured key and token (none: open)."""
    admin_secret = admin_token or api_key

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith("/v1/") and api_key and not _matches(request, api_key):
            raise ApiError("Incorrect API key provided.", status=401, code="invalid_api_key")
        if path.startswith("/admin/") and admin_secret and not _matches(request, admin_secret):
            raise ApiError("this endpoint needs the admin token", status=401,
                           code="invalid_api_key")
        return await handler(request)

    return middleware
