"""Calls from web pages of other origins (CORS), on the client API only, off by default.

A web app served from another origin (a chat UI on ``http://localhost:3000``) calls the gateway
with ``fetch()``: the browser first asks in a *preflight* (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) whether it may, then sends the request, and lets the page
read the answer only when it names the page's origin in ``Access-Control-Allow-Origin``.
``--cors-origin ORIGIN`` (repeatable; ``*``: any origin) lists the origins whose pages may; with
none (the default) the gateway answers no preflight and adds no CORS header.

For an allowed origin, on the client API (``/v1/*`` and the engine API,
:func:`~gateway.contracts.engine_paths.is_client_api`):

* a preflight is answered 204 with the origin, the methods (``GET, POST, OPTIONS``), the request
  headers the browser asked for (the ``openai`` JavaScript SDK sends several of its own) and
  ``Access-Control-Max-Age: 600``. It needs no API key: browsers send none on a preflight, and
  it runs nothing. A preflight from another origin, for another method or of another path gets
  403 in the OpenAI shape (the browser then refuses the call);
* every answer, errors included (a 401 or a 429 the page should be able to read), carries the
  origin, ``Vary: Origin`` and the headers a page may read besides the simple ones: the request
  id, ``Retry-After``, ``Server-Timing`` and the routing headers the caller is shown.

Cookies are never allowed (no ``Access-Control-Allow-Credentials``): API keys go in the
``Authorization`` header, which a page sends itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from aiohttp import web

from gateway.auth import Forbidden
from gateway.contracts.engine_paths import is_client_api

ANY = "*"
_HOST_PORT = re.compile(
    r"(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_HEADER_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")
_MAX_HEADER_LIST = 2048
METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = 600
# What a page may read of an answer besides the CORS-safelisted headers.
EXPOSED = ("x-request-id, Retry-After, Server-Timing, x-route-worker, x-route-policy, "
           "x-route-reason, x-prefix-match-blocks, x-cache-matched-tokens, "
           "x-cache-input-tokens")


def normal_origin(origin: str) -> str:
    """``origin`` as browsers send it (``scheme://host[:port]``, lower case), or ``*``; raises
    ValueError for anything else (a path, a trailing slash, a bare host)."""
    origin = origin.strip()
    if origin == ANY:
        return ANY
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not _HOST_PORT.fullmatch(rest):
        raise ValueError(f"not an origin (scheme://host[:port], or *): {origin!r}")
    return f"{scheme.lower()}://{rest.lower()}"


class Cors:
    def __init__(self, origins: Iterable[str]) -> None:
        normal = {normal_origin(o) for o in origins}
        self.any = ANY in normal
        self.origins = frozenset(normal - {ANY})

    @property
    def enabled(self) -> bool:
        return self.any or bool(self.origins)

    def allowed(self, origin: str | None) -> bool:
        return bool(origin) and (self.any or origin in self.origins)

    def _allow_origin(self, origin: str) -> str:
        return ANY if self.any else origin

    def preflight(self, request: web.Request) -> web.StreamResponse | None:
        """The answer to a CORS preflight (None: ``request`` is not one)."""
        headers = request.headers
        origin = headers.get("Origin")
        method = headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return None
        if not (self.allowed(origin) and is_client_api(request.path)
                and method.upper() in ("GET", "POST")):
            raise Forbidden(f"cross-origin {method[:20]} to {request.path[:200]} is not "
                            "allowed from this origin (--cors-origin)", code="cors_forbidden")
        asked = headers.get("Access-Control-Request-Headers", "").strip()
        response = web.Response(status=204, headers={
            "Access-Control-Allow-Origin": self._allow_origin(origin),
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Max-Age": str(MAX_AGE_S),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        })
        if asked and len(asked) <= _MAX_HEADER_LIST and _HEADER_LIST.fullmatch(asked):
            response.headers["Access-Control-Allow-Headers"] = asked
        return response

    def decorate(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before an answer goes out: the CORS headers, for an allowed origin's call to the
        client API."""
        origin = request.headers.get("Origin")
        if not self.allowed(origin) or not is_client_api(request.path):
            return
        assert origin is not None
        headers = response.headers
        if "Access-Control-Allow-Origin" in headers:  # a preflight's, already complete
            return
        headers["Access-Control-Allow-Origin"] = self._allow_origin(origin)
        headers["Access-Control-Expose-Headers"] = EXPOSED
        headers.add("Vary", "Origin")
