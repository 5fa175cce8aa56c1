"""The client connection cap: counting, refusing past it, and its automatic size."""

from __future__ import annotations

import json
import logging
import resource

import pytest

from gateway.contracts.httpserver import ConnectionCap, busy_answer, client_connection_cap


def test_the_cap_refuses_past_its_limit_and_warns_once_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    cap = ConnectionCap(2)
    assert cap.take()
    assert cap.take()
    assert not cap.take()
    assert not cap.take()
    assert (cap.open, cap.refused) == (2, 2)
    assert len(caplog.records) == 1  # not one line per refused connection
    cap.give_back()
    assert cap.take()
    unlimited = ConnectionCap(0)
    assert all(unlimited.take() for _ in range(1000))
    with pytest.raises(ValueError, match="cap"):
        ConnectionCap(-1)


def test_the_busy_answer_is_a_whole_http_answer_in_the_openai_shape() -> None:
    head, _, body = busy_answer("affinity-gateway").partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert f"Content-Length: {len(body)}" in lines
    assert "Connection: close" in lines
    assert "Server: affinity-gateway" in lines
    assert json.loads(body)["error"]["type"] == "server_error"


def test_the_automatic_cap_leaves_room_for_the_workers() -> None:
    assert client_connection_cap(500, 1024) == 500
    cap = client_connection_cap(0, 1024)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # raised to the hard limit by now
    assert cap == max(64, soft - 1024 - 256)
