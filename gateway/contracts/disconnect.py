"""Cancel a request's handler as soon as its client disconnects (gateway and worker alike).

aiohttp (``handler_cancellation=False``, its default) lets a handler run on after its client is
gone. In the gateway, a request waiting for a worker's answer (queued there, in prefill, or
generating a non-streaming reply) would keep its upstream connection and the worker would
generate for nobody; in the worker, a queued or non-streaming generation would keep its slot.
This middleware watches the request's connection while the handler runs and cancels the
handler's task once the connection is closed: the gateway then closes the upstream response (not
returned to the pool half-read), which the worker sees as its own client going away, and the
worker's engine gives the queue entry or KV blocks back at once.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

CHECK_INTERVAL_S = 0.05  # how often an in-flight request's connection is looked at


def client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def cancel_on_disconnect(interval_s: float = CHECK_INTERVAL_S) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal handle
            if client_gone(request):
                if task is not None:
                    task.cancel("the client disconnected")
                return
            handle = loop.call_later(interval_s, check)

        handle = loop.call_later(interval_s, check)
        try:
            return await handler(request)
        finally:
            handle.cancel()

    return middleware
