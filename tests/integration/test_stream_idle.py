"""Workers that stall: mid-stream (the stream idle timeout) and probes that time out while the
worker keeps streaming (it stays in the pool)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest
from aiohttp import web

from gateway.settings import GatewaySettings
from tests.conftest import MODEL, Processes, admin_workers, free_port, gateway_over, serve


async def _inflight(http: aiohttp.ClientSession, gateway: str) -> int:
    return sum(int(w["inflight_requests"]) for w in (await admin_workers(http, gateway)).values())


async def _wait_healthy(http: aiohttp.ClientSession, gateway: str, wid: str) -> None:
    for _ in range(300):
        view = (await admin_workers(http, gateway)).get(wid)
        if view is not None and view["healthy"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{wid} never came up")


def _events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]


async def test_worker_hung_mid_stream_ends_the_stream_with_an_error_event(
    processes: Processes,
) -> None:
    url, proc = await processes.worker()
    wid = url.removeprefix("http://")
    body = {"model": MODEL, "max_tokens": 2000, "stream": True,
            "messages": [{"role": "user", "content": "a long story"}]}
    async with gateway_over(
        [url], stream_idle_timeout_s=0.5, breaker_failures=1, breaker_cooldown_s=3600.0,
        health_interval_s=3600.0,
    ) as gateway, aiohttp.ClientSession() as http:
        await _wait_healthy(http, gateway, wid)
        async with http.post(gateway + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            received = await response.content.readany()
            assert received  # bytes reached the client: the request can no longer move
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                received += await asyncio.wait_for(response.content.read(), 60)
                view = await admin_workers(http, gateway)
                inflight = await _inflight(http, gateway)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        events = _events(received)
        assert events[-1] != "[DONE]"
        error = json.loads(events[-1])["error"]
        assert error["code"] == "stream_idle_timeout"
        assert error["type"] == "upstream_error"
        assert inflight == 0  # the gateway let go of the request
        assert view[wid]["breaker"] == "open"  # the stall counted as a failure


async def test_idle_timeout_spares_a_stream_that_keeps_sending(processes: Processes) -> None:
    url, _ = await processes.worker("--decode-ms-per-token", "20")
    body = {"model": MODEL, "max_tokens": 60, "stream": True,
            "messages": [{"role": "user", "content": "steady"}]}
    # Tokens every 20 ms, an idle timeout of 0.3 s: the stream is slow overall, never idle.
    async with gateway_over([url], stream_idle_timeout_s=0.3) as gateway, \
            aiohttp.ClientSession() as http:
        await _wait_healthy(http, gateway, url.removeprefix("http://"))
        async with http.post(gateway + "/v1/chat/completions", json=body) as response:
            events = _events(await response.read())
        assert events[-1] == "[DONE]"
        assert not any('"error"' in e for e in events)


class _BusyWorker:
    """A stand-in engine server: streams on request, and its ``/health`` can be made to hang
    (the way a worker under a burst answers probes late)."""

    def __init__(self) -> None:
        self.health_hangs = False
        self.hung_probes = 0
        self.streaming = asyncio.Event()
        self.stop_streaming = asyncio.Event()
        self.closing = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.health_hangs:
            self.hung_probes += 1
            await self.closing.wait()
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.streaming.set()
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
        while not self.stop_streaming.is_set():
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response


async def _hung_probes_at_least(worker: _BusyWorker, n: int) -> None:
    for _ in range(600):
        if worker.hung_probes >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {worker.hung_probes} probes reached the worker")


async def test_probe_timeouts_do_not_eject_a_worker_that_keeps_streaming() -> None:
    fake = _BusyWorker()
    port = free_port()
    runner = await serve(fake.app(), port)
    url = f"http://127.0.0.1:{port}"
    wid = url.removeprefix("http://")
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with gateway_over([url], health_interval_s=0.1) as gateway, \
                aiohttp.ClientSession() as http:
            await _wait_healthy(http, gateway, wid)
            stream = asyncio.create_task(http.post(gateway + "/v1/chat/completions", json=body))
            await fake.streaming.wait()
            fake.health_hangs = True
            # A second hung probe starts only once the first round timed out and was judged.
            await _hung_probes_at_least(fake, 2)
            assert (await admin_workers(http, gateway))[wid]["healthy"] is True
            fake.stop_streaming.set()
            response = await stream
            events = _events(await response.read())
            assert events[-1] == "[DONE]"
            # Silent now: a later timed-out round finds it down.
            for _ in range(600):
                if not (await admin_workers(http, gateway))[wid]["healthy"]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a silent worker whose probes time out stayed up")
    finally:
        fake.closing.set()
        await runner.cleanup()


def test_negative_stream_idle_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_idle_timeout_s"):
        GatewaySettings(stream_idle_timeout_s=-1)
