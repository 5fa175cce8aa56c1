"""A Responses API request read as the chat it amounts to (gateway.contracts.responses)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.contracts.chat import ChatFormatError, canonical_json, render_chat
from gateway.contracts.responses import as_chat_body, chat_messages


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert chat_messages({"instructions": "be brief", "input": "hi"}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_items_become_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    messages = chat_messages({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "look: "}, image]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        call, output, {"type": "reasoning", "encrypted_content": "xyz"},
    ]})
    assert messages == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "look: " + canonical_json(image)},
        {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": canonical_json(call)},
        {"role": "tool", "content": canonical_json(output)},
        {"role": "assistant", "content": canonical_json(
            {"type": "reasoning", "encrypted_content": "xyz"})},
    ]


def test_a_next_turn_renders_as_an_extension_of_the_last() -> None:
    turn: list[Any] = [{"role": "user", "content": "a"}]
    later = [*turn, {"role": "assistant", "content": "b"},
             {"type": "function_call_output", "call_id": "c", "output": "x"},
             {"role": "user", "content": "c"}]
    first = render_chat(chat_messages({"instructions": "s", "input": turn}))
    second = render_chat(chat_messages({"instructions": "s", "input": later}))
    assert second.startswith(first.removesuffix("<|assistant|>\n"))


def test_the_chat_body_carries_the_rest() -> None:
    chat = as_chat_body({"model": "m", "input": "hi", "max_output_tokens": 7, "stream": True,
                         "temperature": 0.5, "cache_salt": "s", "store": False,
                         "tools": [{"type": "function", "name": "f"}], "tool_choice": "none"})
    assert chat == {"messages": [{"role": "user", "content": "hi"}], "model": "m",
                    "stream": True, "temperature": 0.5, "cache_salt": "s",
                    "tools": [{"type": "function", "name": "f"}], "tool_choice": "none",
                    "max_tokens": 7}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": 5}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text"),
    ({"input": "x", "instructions": ["x"]}, "instructions"),
    ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
])
def test_what_is_not_a_responses_request_names_its_parameter(
        body: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatFormatError) as caught:
        as_chat_body(body)
    assert caught.value.param == param
