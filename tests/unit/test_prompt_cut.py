"""A forwarded body cut to the first characters of its fingerprint text (gateway.prompt_cut)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.normalize import render_chat
from gateway.openai_schema import ClientJSON
from gateway.prompt_cut import cut_body

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer from the manual. " * 4},
    {"role": "user", "content": [{"type": "text", "text": "Manual: gears turn. " * 3},
                                 {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                 {"type": "text", "text": "Which gear turns first?"}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "lookup", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "The left one."},
    {"role": "user", "name": "ann", "content": "And then?"},
]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_every_cut_of_a_chat_renders_as_a_prefix_of_its_text(tools: list[Any] | None) -> None:
    """At every cut point the cut chat renders as a prefix of the whole chat's text; where the
    cut falls in a text content, exactly as the text up to the cut, and never shorter than the
    messages before the one it falls in."""
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "max_tokens": 9}
    if tools:
        body["tools"] = tools
    text = render_chat(MESSAGES, tools)
    exact = 0
    for chars in range(len(text) + 2):
        cut = cut_body(CHAT, body, chars)
        if cut is None:
            continue
        assert cut["max_tokens"] == 9
        assert cut.get("tools") == tools
        rendered = render_chat(cut["messages"], tools)
        assert text.startswith(rendered)
        assert len(rendered) <= chars
        before = render_chat(MESSAGES[:len(cut["messages"]) - 1], tools)
        assert len(rendered) > len(before)  # more than the whole messages before the cut one
        exact += rendered == text[:chars]
    assert exact > len(text) // 3  # many cut points fall in a text


def test_a_chat_cut_inside_a_message_keeps_the_messages_before_it_whole() -> None:
    text = render_chat(MESSAGES)
    start = text.index("Which gear")
    cut = cut_body(CHAT, {"messages": MESSAGES}, start + 5)
    assert cut is not None
    assert cut["messages"][0] == MESSAGES[0]
    assert cut["messages"][1]["content"][-1] == {"type": "text", "text": "Which"}
    assert len(cut["messages"][1]["content"]) == 3
    # In the image part: the parts before it.
    inside_image = text.index("image_url") + 3
    cut = cut_body(CHAT, {"messages": MESSAGES}, inside_image)
    assert cut is not None
    assert cut["messages"][1]["content"] == MESSAGES[1]["content"][:1]


def test_no_cut_at_or_before_the_first_message_or_past_the_end() -> None:
    body = {"messages": MESSAGES, "tools": TOOLS}
    text = render_chat(MESSAGES, TOOLS)
    assert cut_body(CHAT, body, len(text)) is None
    assert cut_body(CHAT, body, len(text) + 100) is None
    assert cut_body(CHAT, body, 3) is None  # inside the tools
    assert cut_body(CHAT, {"messages": MESSAGES}, 2) is None  # in the first message's header
    assert cut_body(CHAT, {"messages": "no"}, 10) is None
    assert cut_body(CHAT, {"messages": MESSAGES}, 0) is None
    assert cut_body("/v1/responses", {"input": "hello there"}, 5) is None


@pytest.mark.parametrize(("prompt", "chars", "expected"), [
    ("abcdefgh", 3, "abc"),
    ("abcdefgh", 8, None),
    (["abcdefgh", "xyz"], 5, "abcde"),  # several prompts: the first, as fingerprinted
    ([101, 2020, 3], 8, [101, 2020]),  # "101 2020 3": the ids that end within the cut
    ([101, 2020, 3], 7, [101]),
    ([101, 2020, 3], 2, None),
    ([[101, 2020, 3], [4]], 4, [101]),
    ([101, 2020, 3], 10, None),
])
def test_a_completions_prompt_is_cut_where_its_text_is(prompt: Any, chars: int,
                                                       expected: Any) -> None:
    cut = cut_body(COMPLETIONS, {"model": "m", "prompt": prompt}, chars)
    assert (cut["prompt"] if cut is not None else None) == expected


def random_chat(rng: random.Random) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """A chat of 1-6 messages of every shape the renderer knows, and tools or none."""
    def text() -> str:
        return "".join(rng.choice("ab \u00e9\u4e2d\U0001f600\n") for _ in range(rng.randint(0, 40)))

    messages: list[dict[str, Any]] = []
    for _ in range(rng.randint(1, 6)):
        role = rng.choice(["system", "user", "assistant", "tool"])
        message: dict[str, Any] = {"role": role}
        shape = rng.random()
        if shape < 0.5:
            message["content"] = text()
        elif shape < 0.8:
            message["content"] = [rng.choice([{"type": "text", "text": text()},
                                              {"type": "image_url", "image_url": {"url": text()}}])
                                  for _ in range(rng.randint(1, 3))]
        else:
            message["content"] = None
            message["tool_calls"] = [{"id": "c", "type": "function",
                                      "function": {"name": "f", "arguments": text()}}]
        if rng.random() < 0.2:
            message["name"] = text()[:5]
        if role == "tool" and rng.random() < 0.7:
            message["tool_call_id"] = "c"
        messages.append(message)
    return messages, (TOOLS if rng.random() < 0.3 else None)


@pytest.mark.parametrize("seed", range(40))
def test_no_cut_of_any_chat_renders_past_its_cut_or_off_its_text(seed: int) -> None:
    rng = random.Random(seed)
    messages, tools = random_chat(rng)
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    text = render_chat(messages, tools)
    for chars in range(len(text) + 1):
        cut = cut_body(CHAT, body, chars)
        if cut is not None:
            rendered = render_chat(cut["messages"], tools)
            assert text.startswith(rendered)
            assert 0 < len(rendered) <= chars
            assert cut["messages"]  # never an empty chat


def test_a_cut_of_the_clients_own_bytes_is_a_new_body() -> None:
    """A body forwarded as the client's bytes (``ClientJSON``) is cut into a plain object, so
    the backend encodes the cut prompt instead of sending the client's whole bytes."""
    body = {"model": "m", "prompt": "abcdefgh"}
    cut = cut_body(COMPLETIONS, ClientJSON(body, json.dumps(body).encode()), 3)
    assert cut is not None
    assert type(cut) is dict
    assert cut == {"model": "m", "prompt": "abc"}
