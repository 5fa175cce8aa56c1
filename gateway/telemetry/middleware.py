"""Request ids and the per-request telemetry record (begun and finished around every handler
by the application's middleware, :mod:`gateway.app`).

The request id is the client's ``x-request-id`` when it is a sane token (letters, digits and
``._:/+=@-``, at most 128 characters), else a new random one; it goes to the worker, back to the
client on every response (errors included), into the access log and onto the span.
"""

from __future__ import annotations

import random
import re

from aiohttp import web
from opentelemetry.trace import SpanKind

from gateway.telemetry.access_log import QUIET_PATHS, QUIET_PREFIXES
from gateway.telemetry.record import RequestRecord, Telemetry

TELEMETRY_KEY = web.AppKey("telemetry", Telemetry)
RECORD_KEY = web.RequestKey("telemetry_record", RequestRecord)
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id_from(value: str | None) -> str:
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return f"{random.getrandbits(128):032x}"  # an id, not a secret: no urandom call


def record_of(request: web.Request) -> RequestRecord:
    return request[RECORD_KEY]


def _route_name(request: web.Request) -> str:
    # A request of the lean HTTP path has no route match: its path is its route's name.
    match = getattr(request, "match_info", None)
    info = match.route.resource if match is not None else None
    return info.canonical if info is not None else request.path


def sent_bytes(response: web.StreamResponse) -> int:
    """The body bytes a response sent (or will send, when not prepared yet)."""
    if response.prepared:
        return response.body_length
    body = response.body if isinstance(response, web.Response) else None
    return len(body) if isinstance(body, bytes | bytearray) else 0


def begin(telemetry: Telemetry, request: web.Request) -> RequestRecord:
    """The record of a request that just arrived (with its server span when tracing); the
    caller hands it to :meth:`Telemetry.finish` once the response went out."""
    method, path = request.method, request.path
    record = RequestRecord(
        telemetry, request_id_from(request.headers.get(REQUEST_ID_HEADER)), method, path)
    request[RECORD_KEY] = record
    tracer = telemetry.tracing.tracer
    if tracer is not None and path not in QUIET_PATHS and not path.startswith(QUIET_PREFIXES):
        record.span = tracer.start_span(
            f"{method} {_route_name(request)}",
            context=telemetry.tracing.extract(request.headers), kind=SpanKind.SERVER,
            start_time=record.started_ns,
            attributes={"http.request.method": method, "url.path": path},
        )
    return record


def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Before a response goes out: every response carries the request id."""
    record = request.get(RECORD_KEY)
    if record is not None:
        response.headers[REQUEST_ID_HEADER] = record.request_id
