"""How the lean HTTP path writes a whole answer (gateway.contracts.lean_http)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from gateway.contracts.lean_http import LeanConnection, LeanRoutes


class _Transport(asyncio.Transport):
    """Keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Server:
    def admit(self, conn: Any, transport: asyncio.BaseTransport) -> bool:
        return True

    def release(self, conn: Any) -> None:
        return None

    def adopt(self, conn: Any, transport: asyncio.Transport) -> asyncio.Protocol:
        raise AssertionError("not handed over here")


async def _middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    return web.Response()


async def _connection() -> tuple[LeanConnection, _Transport]:
    conn = LeanConnection(_Server(), LeanRoutes(web.Application(), {}, _middleware), 75.0)
    transport = _Transport()
    conn.connection_made(transport)
    return conn, transport


async def test_a_whole_answer_carries_its_headers_length_and_date() -> None:
    conn, transport = await _connection()
    conn._write_whole(201, {"X-Route-Worker": "w1", "Content-Length": "99"}, b"hello")
    head, _, body = transport.written.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 201 Created"
    assert b"X-Route-Worker: w1" in lines
    assert b"Content-Length: 5" in lines  # its own, not the one it was given
    assert sum(line.startswith(b"Date: ") for line in lines) == 1
    assert b"Connection: close" not in lines
    assert body == b"hello"
    conn._write_whole(200, {}, b"", close=True)
    assert transport.written.endswith(b"Connection: close\r\n\r\n")
    conn.connection_lost(None)


@pytest.mark.parametrize("value", ["a\nSet-Cookie: x=1", "a\rb", "a\r\nX-Injected: 1"])
async def test_a_header_with_a_line_break_is_refused_unwritten(value: str) -> None:
    # A worker's header relayed as it came must not split the answer (aiohttp refuses these).
    conn, transport = await _connection()
    with pytest.raises(ValueError, match="line break"):
        conn._write_whole(200, {"Content-Type": value}, b"{}")
    assert transport.written == b""
    conn.connection_lost(None)
