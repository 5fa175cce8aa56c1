"""Gateway and reference worker accept the same chat roles (``function`` included)."""

from __future__ import annotations

import pytest

from gateway.contracts.chat import ROLES, ChatFormatError, render_chat
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import CHAT_ROLES, parse_chat

HISTORY = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "weather", "arguments": "{}"}}]},
]


def test_the_gateway_validates_against_the_roles_the_worker_renders() -> None:
    assert CHAT_ROLES == ROLES


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_role_the_gateway_accepts_renders(role: str) -> None:
    message = {"role": role, "content": "x", "name": "weather"}
    parse_chat({"model": "m", "messages": [*HISTORY, message]}, NormalizeOptions())
    assert f"<|{role} name=weather|>\nx<|end|>\n" in render_chat([*HISTORY, message])


def test_the_deprecated_function_role_renders_with_its_name() -> None:
    text = render_chat([*HISTORY, {"role": "function", "name": "weather", "content": "-3 C"}])
    assert text.endswith("<|function name=weather|>\n-3 C<|end|>\n<|assistant|>\n")


def test_an_unknown_role_is_rejected_by_both() -> None:
    with pytest.raises(ChatFormatError):
        render_chat([{"role": "robot", "content": "x"}])
    assert "robot" not in CHAT_ROLES
