"""Both body memos against whole decoding, on random turns (seeded): each body is the last one
(or the last that decoded) with bytes added or cut where a client, a template or an attacker
would put them: inside the last string, new messages, repeated keys, escapes, stray quotes.
Whatever the memo finds, the body, the parse and what the worker gets must be those of
decoding the body whole (``check_same`` of each memo's own tests). At these counts the runs
find the repeated key that a prompt's end was once taken for (every seed failed on that code
within its 4,800 turns)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.chat_histories import ChatHistories
from gateway.prompt_histories import PromptHistories
from tests.unit import test_chat_histories as chat
from tests.unit import test_prompt_histories as prompt

# Bytes a mutation inserts: JSON syntax, escapes (a NUL, a quote, a backslash, surrogates),
# keys repeated with their values, text the rules rewrite, bytes that are not UTF-8.
_ATOMS = (
    b'"', b"\\", b'\\"', b"\\\\", b"\\n", b"\\u0000", b"\\u0022", b"\\u005c",
    b"\\ud83d\\ude00", b"\\ud83d", b"}", b"{", b",", b":", b"[", b"]", b"null", b"1", b" ",
    b"\n", b"x", b"\\t", b"\\r", b"\r", b" \\n", b"\xff", b"\xe2\x80\x9c", b"\xf0\x9f\x98\x80",
    b"\xc2\xa0", b"\xe2\x80\x8b", b'"prompt":', b'"prompt"', b'"messages":', b"\\u0070",
    b'"model":"m"', b'","model":"m', b'","model":"m"', b',"model":"m"', b',"user":"u"',
    b'","user":"u', b'","prompt":"', b',"cache_salt":"s"', b'"cache_salt":"s"',
    b'"],"messages":[{"role":"user","content":"', b',"messages":[{"role":"user","content":"x"}]',
    b'"},{"role":"user","content":"', b'"},{"role":"assistant","content":"', b'"}]', b'"}]}',
)
_MESSAGES = (
    b',{"role":"user","content":"q \\" x"}',
    b',{"role":"assistant","content":"a\\u00a0b"}',
    b',{"role":"tool","tool_call_id":"c","content":"r \\n"}',
    b',{"role":"user","content":[{"type":"text","text":"p"}]}',
    b',{"content":"k","role":"user"}',
    b',{"role":"user","content":"' + orjson.dumps("\u201cz\u201d \U0001f600")[1:-1] + b'"}',
)
_TEXT = " ab\n\"\\\u201c\u00a0\u200b\U0001f600\t "


def _atoms(rng: random.Random, most: int) -> bytes:
    return b"".join(rng.choice(_ATOMS) for _ in range(rng.randint(1, most)))


def _next_turn(rng: random.Random, raw: bytes) -> bytes:
    roll = rng.random()
    if roll < 0.5:  # text added inside the body's last string (a prompt that grows)
        cut = len(raw) - rng.choice((1, 2, 2, 2, 3, 4))
        if rng.random() < 0.5:
            added = _atoms(rng, 4)
        else:
            text = "".join(rng.choice(_TEXT) for _ in range(rng.randint(1, 30)))
            added = orjson.dumps(text)[1:-1]
        return raw[:cut] + added + raw[cut:]
    if roll < 0.65 and raw.rstrip().endswith(b"]}"):  # a chat's next messages
        cut = raw.rindex(b"]")
        added = b"".join(rng.choice(_MESSAGES) for _ in range(rng.randint(1, 3)))
        return raw[:cut] + added + raw[cut:]
    if roll < 0.8:  # bytes inserted anywhere
        at = rng.randrange(len(raw) + 1)
        return raw[:at] + _atoms(rng, 3) + raw[at:]
    if roll < 0.9:  # a few bytes cut anywhere
        at = rng.randrange(len(raw))
        return raw[:at] + raw[at + rng.randint(1, 8):]
    return raw  # the same body again


def _first_prompt(rng: random.Random) -> bytes:
    text = prompt.context(rng.randint(60, 300))
    body: dict[str, Any]
    match rng.randrange(3):
        case 0:
            body = {"model": "m", "max_tokens": 4, "prompt": text}
        case 1:
            body = {"model": "m", "prompt": text, "max_tokens": 4}
        case _:
            body = {"prompt": text, "model": "m", "max_tokens": 4}
    if rng.random() < 0.2:
        body["cache_salt"] = "s"
    return prompt.dumps(body, rng.choice(("compact", "spaced")))


def _first_chat(rng: random.Random) -> bytes:
    messages = chat.turns(rng.randint(110, 200), 300)  # a history past HISTORY_MIN_CHARS
    body: dict[str, Any] = ({"model": "m", "messages": messages, "max_tokens": 4}
                            if rng.random() < 0.7 else {"messages": messages, "model": "m"})
    if rng.random() < 0.2:
        body["cache_salt"] = "s"
    return chat.dumps(body, rng.choice(("compact", "spaced")))


def _joins(first: Callable[[random.Random], bytes], gateway: Callable[[], Any],
           check: Callable[[Any, bytes], Any], seed: int, chats: int, turns: int) -> int:
    """Checks ``chats`` random conversations of ``turns`` bodies; how many were joined."""
    rng = random.Random(seed)
    joined = 0
    for _ in range(chats):
        memo = gateway()
        raw = last_good = first(rng)
        for _ in range(turns):
            if check(memo, raw) is not None:
                joined += 1
            try:
                orjson.loads(raw)
                last_good = raw
            except orjson.JSONDecodeError:
                pass
            raw = _next_turn(rng, last_good if rng.random() < 0.7 else raw)
    return joined


@pytest.mark.parametrize("seed", range(4))
def test_prompt_memo_decodes_random_turns_as_a_whole_decoding_does(seed: int) -> None:
    joined = _joins(_first_prompt, lambda: prompt.Gateway(PromptHistories(min_bytes=1024)),
                    prompt.check_same, seed, chats=400, turns=12)
    assert joined >= 200  # the memo took part: hundreds of the 4,800 turns were joined


@pytest.mark.parametrize("seed", range(4))
def test_chat_memo_decodes_random_turns_as_a_whole_decoding_does(seed: int) -> None:
    joined = _joins(_first_chat, lambda: chat.Gateway(ChatHistories(min_bytes=1024)),
                    chat.check_same, seed, chats=60, turns=12)
    assert joined >= 30  # of 720 turns
