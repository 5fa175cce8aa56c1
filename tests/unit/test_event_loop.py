from __future__ import annotations

import asyncio
import importlib.util

import pytest

from gateway.__main__ import new_event_loop
from gateway.settings import GatewaySettings


def test_asyncio_loop_on_request() -> None:
    loop = new_event_loop("asyncio")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
@pytest.mark.parametrize("choice", ["auto", "uvloop"])
def test_uvloop_when_installed(choice: str) -> None:
    loop = new_event_loop(choice)
    try:
        assert type(loop).__module__.startswith("uvloop")
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()


def test_unknown_event_loop_is_rejected() -> None:
    with pytest.raises(ValueError, match="event_loop"):
        GatewaySettings(event_loop="trio")
