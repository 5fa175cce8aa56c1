"""Which bodies are parsed on the parse pool's thread, and that its parse is the loop's."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import parse_chat
from gateway.parse_pool import ParsePool, item_count


def test_items_are_the_new_messages_their_parts_tools_and_batch_prompts() -> None:
    messages = [{"role": "user", "content": "a"}] * 5 + [
        {"role": "user", "content": [{"type": "text", "text": "b"}] * 3}]
    assert item_count({"messages": messages}) == 6 + 3
    assert item_count({"messages": messages}, known_messages=5) == 1 + 3
    assert item_count({"messages": messages, "tools": [{}] * 4}) == 9 + 4
    assert item_count({"prompt": "one string"}) == 0
    assert item_count({"prompt": ["a", "b", "c"]}) == 3
    assert item_count({"prompt": [1, 2, 3, 4]}) == 4
    assert item_count({"prompt": [[1, 2], [3, 4, 5]]}) == 2 + 5
    assert item_count({"messages": "not a list", "tools": None, "prompt": None}) == 0


def test_the_pool_takes_bodies_from_its_threshold_and_never_at_zero() -> None:
    body = {"prompt": ["a"] * 10}
    assert ParsePool(10).wants(body, 60)
    assert not ParsePool(11).wants(body, 60)
    assert not ParsePool(0).wants(body, 60)
    assert not ParsePool(10).wants(body, 19)  # too few bytes for ten items: not counted
    with pytest.raises(ValueError, match="min_items"):
        ParsePool(-1)


async def test_a_thread_parse_returns_and_raises_what_the_loop_parse_does() -> None:
    pool = ParsePool(1)
    opts = NormalizeOptions()
    body = {"model": "m", "messages": [{"role": "user", "content": "a\u00a0b\u200b "}] * 3}
    try:
        on_thread = await pool.parse(parse_chat, body, opts)
        on_loop = parse_chat(body, opts)
        assert on_thread.body == on_loop.body
        assert on_thread.fingerprint_text == on_loop.fingerprint_text
        assert on_thread.body["messages"][0]["content"] == "a b"
        bad = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "robot"}]}
        with pytest.raises(InvalidRequest, match=r"messages\[1\]\.role"):
            await pool.parse(parse_chat, bad, opts)
        assert pool.parsed == 2
    finally:
        pool.close()
