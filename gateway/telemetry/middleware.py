"""Request ids and per-request telemetry around every handler.

The request id is the client's ``x-request-id`` when it is a sane token (letters, digits and
``._:/+=@-``, at most 128 characters), else a new random one; it goes to the worker, back to the
client on every response (errors included), into the access log and onto the span.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind

from gateway.telemetry.access_log import QUIET_PATHS, QUIET_PREFIXES
from gateway.telemetry.record import RequestRecord, Telemetry

TELEMETRY_KEY = web.AppKey("telemetry", Telemetry)
RECORD_KEY = web.RequestKey("telemetry_record", RequestRecord)
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_id_from(value: str | None) -> str:
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return f"{random.getrandbits(128):032x}"  # an id, not a secret: no urandom call


def record_of(request: web.Request) -> RequestRecord:
    return request[RECORD_KEY]


def note_error(request: web.Request, code: str) -> None:
    """The gateway answered this request with an error of its own (counted by code)."""
    record = request.get(RECORD_KEY)
    if record is not None:
        record.error_code = code


def _route_name(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else request.path


def _sent_bytes(response: web.StreamResponse) -> int:
    if response.prepared:
        return response.body_length
    body = response.body if isinstance(response, web.Response) else None
    return len(body) if isinstance(body, bytes | bytearray) else 0


@web.middleware
async def telemetry_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    telemetry = request.app[TELEMETRY_KEY]
    record = RequestRecord(
        telemetry, request_id_from(request.headers.get(REQUEST_ID_HEADER)), request.method,
        request.path,
    )
    request[RECORD_KEY] = record
    tracer = telemetry.tracing.tracer
    path = request.path
    if tracer is not None and path not in QUIET_PATHS and not path.startswith(QUIET_PREFIXES):
        record.span = tracer.start_span(
            f"{request.method} {_route_name(request)}",
            context=telemetry.tracing.extract(request.headers), kind=SpanKind.SERVER,
            start_time=record.started_ns,
            attributes={"http.request.method": request.method, "url.path": path},
        )
    status, sent = 500, 0
    try:
        response = await handler(request)
        status, sent = response.status, _sent_bytes(response)
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away
        raise
    finally:
        telemetry.finish(record, status, sent)


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every response carries the request id."""
    record = request.get(RECORD_KEY)
    if record is not None:
        response.headers[REQUEST_ID_HEADER] = record.request_id
