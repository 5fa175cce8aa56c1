"""SIGTERM drains: a worker or gateway process stops accepting and finishes what is in flight."""

from __future__ import annotations

import asyncio
import signal

import aiohttp

from tests.conftest import MODEL, Processes


def _body(stream: bool) -> dict[str, object]:
    # 300 tokens at 2 ms each: still generating when the signal arrives.
    return {"model": MODEL, "max_tokens": 300, "stream": stream,
            "messages": [{"role": "user", "content": "a long answer, please"}]}


async def _complete(http: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, bytes]:
    async with http.post(url + "/v1/chat/completions", json=_body(stream)) as response:
        return response.status, await response.read()


async def _in_flight_finish(url: str, proc: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as http:
        requests = [asyncio.create_task(_complete(http, url, stream)) for stream in (False, True)]
        await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*requests)
        assert await proc.wait() == 0
        whole, streamed = results
        assert whole[0] == 200
        assert b'"completion_tokens":300' in whole[1].replace(b" ", b"")
        assert streamed[0] == 200
        assert streamed[1].rstrip().endswith(b"data: [DONE]")
        # Stopped accepting: a new request is refused.
        try:
            status, _ = await _complete(http, url, False)
        except aiohttp.ClientConnectionError:
            status = 0
        assert status == 0


async def test_worker_sigterm_finishes_in_flight_requests(processes: Processes) -> None:
    url, proc = await processes.worker()
    await _in_flight_finish(url, proc)


async def test_gateway_sigterm_finishes_in_flight_requests(processes: Processes) -> None:
    worker, _ = await processes.worker()
    gateway = await processes.gateway("--worker", worker)
    await _in_flight_finish(gateway, processes.procs[-1])
