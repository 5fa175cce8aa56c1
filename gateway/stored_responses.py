"""Requests about one stored Responses API answer, relayed to the worker that made it.

``GET /v1/responses/{id}`` (the response), ``GET /v1/responses/{id}/input_items``,
``POST /v1/responses/{id}/cancel`` and ``DELETE /v1/responses/{id}`` go to the worker the id is
pinned to (:mod:`gateway.response_pins`) and to no other: only that one has it. An id with no
pin under the caller's tenant is answered 404 by the gateway, as OpenAI answers an unknown id:
another tenant's response is never looked up. A deletion the worker confirms drops the pin.
With pins off (``--response-pin-ttl-s 0``: engines that share their store) these requests go to
the least loaded worker that serves HTTP, as the rest of the engine's API does.

A next turn by ``previous_response_id`` is a completion like any other and takes the routed
path (:func:`gateway.api.responses`), to the worker :meth:`ResponsePins.continued_on` names.
"""

from __future__ import annotations

from urllib.parse import quote

from aiohttp import web

from gateway.api import STATE, admit_unread, read_body
from gateway.backends.base import UpstreamRequest
from gateway.contracts.responses import RESPONSES_PATH, STORED_RESPONSE_PATHS
from gateway.engine_api import dispatch
from gateway.limits import LIMITS_KEY
from gateway.telemetry.middleware import record_of

POLICY = "response_pin"  # the policy label of these requests in metrics and headers


async def relay(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    settings = state.settings
    identity, hold = admit_unread(request)
    try:
        if request.method == "POST":  # a cancellation carries nothing the worker needs
            await read_body(request, settings.max_body_bytes, settings.body_timeout_s, hold)
        response_id = request.match_info["response_id"]
        record = record_of(request)
        record.tenant, record.policy = identity.tenant_id, POLICY
        # Without pins (engines that share their store) any worker serving HTTP answers.
        home = (await state.pins.home_in(state.pool, identity.tenant_id, response_id)
                if state.pins.enabled else None)
        path = RESPONSES_PATH + "/" + quote(response_id, safe="")
        rest = request.match_info.get("rest")
        if rest:
            path += "/" + rest
        if request.query_string:
            path += "?" + request.rel_url.raw_query_string
        upstream = UpstreamRequest(path=path, body={}, method=request.method)
        async with request.app[LIMITS_KEY].admitted(identity.tenant, 1):
            response = await dispatch(request, state, upstream, None, 1, only=home,
                                      policy=POLICY)
        if request.method == "DELETE" and response.status == 200 and home is not None:
            await state.pins.forget(identity.tenant_id, response_id)
        return response
    finally:
        hold.release()


def add_routes(app: web.Application) -> None:
    one, items, cancel = STORED_RESPONSE_PATHS
    app.router.add_get(one, relay)
    app.router.add_delete(one, relay)
    app.router.add_get(items.replace("input_items", "{rest:input_items}"), relay)
    app.router.add_post(cancel.replace("cancel", "{rest:cancel}"), relay)
