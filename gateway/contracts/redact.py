"""Secrets out of what the gateway shows or logs (pure functions)."""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

_SECRET_QUERY_WORDS = ("password", "passwd", "secret", "token", "key", "auth")


def redact_url(url: str) -> str:
    """``url`` with any password (``scheme://user:pw@host``) and secret-looking query values
    replaced by ``***``; the scheme, host, port, path and user name stay readable."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "***"
    netloc = parts.netloc
    if parts.password is not None or "@" in netloc:
        user = parts.username or ""
        hostport = f"[{host}]" if ":" in host else host
        if port is not None:
            hostport += f":{port}"
        netloc = f"{user}:***@{hostport}" if user else f"***@{hostport}"
    query = parts.query
    if netloc == parts.netloc and not query:
        return url
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([
            (k, "***" if any(w in k.lower() for w in _SECRET_QUERY_WORDS) else v)
            for k, v in pairs
        ], safe="*/")
    return urlunsplit(SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment))
