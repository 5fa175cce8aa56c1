"""Long chats decoded from their new messages on (gateway.chat_histories): the body, the parse
and the errors are those of decoding and parsing the whole body, on every shape of body."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.chat_histories import ChatHistories, Known
from gateway.errors import InvalidRequest
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import (
    HISTORY_MIN_CHARS,
    MAX_JSON_DEPTH,
    ParsedRequest,
    decode_json_object,
    encode_body,
    parse_chat,
)

OPTS = NormalizeOptions()


def turns(count: int, chars: int = 300) -> list[dict[str, Any]]:
    """An agent's messages: a system prompt, then tool calls and their results in turn."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(count):
        if i % 2 == 0:
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function",
                "function": {"name": "read", "arguments": json.dumps({"path": f"f{i}.py"})}}]})
        else:
            line = f"line {i} of the file, with words enough to fill it; "
            out.append({"role": "tool", "tool_call_id": f"call_{i - 1}",
                        "content": (line * (chars // len(line) + 1))[:chars].rstrip()})
    return out


HISTORY = turns(400)  # about 60k characters rendered: a long chat


class Gateway:
    """What the gateway's chat route does with a body (gateway.api): decode with the memo,
    parse with what it found, remember what the parse kept."""

    def __init__(self, histories: ChatHistories | None = None, tenant: str = "t") -> None:
        self.histories = histories if histories is not None else ChatHistories(min_bytes=1024)
        self.seed = self.histories.seed(tenant, OPTS)

    def send(self, raw: bytes) -> tuple[dict[str, Any], ParsedRequest, Known | None]:
        body, found = self.histories.decode(raw, self.seed)
        parsed = parse_chat(body, OPTS, None, found.history if found is not None else None,
                            keep_history=True)
        if parsed.history is not None:
            self.histories.remember(raw, self.seed, body, parsed.history, found)
        return body, parsed, found


def whole(raw: bytes) -> tuple[dict[str, Any], ParsedRequest] | InvalidRequest:
    """``raw`` decoded and parsed whole, or the error that gives."""
    try:
        body = decode_json_object(raw)
        return body, parse_chat(body, OPTS)
    except InvalidRequest as exc:
        return exc


def check_same(gateway: Gateway, raw: bytes) -> Known | None:
    """``raw`` through the memo gives what decoding and parsing it whole gives."""
    expected = whole(raw)
    if isinstance(expected, InvalidRequest):
        with pytest.raises(InvalidRequest) as raised:
            gateway.send(raw)
        assert (str(raised.value), raised.value.param) == (str(expected), expected.param)
        return None
    expected_body, parsed_whole = expected
    body, parsed, found = gateway.send(raw)
    assert body == expected_body
    assert list(body) == list(expected_body)  # the keys in the body's order
    assert parsed.fingerprint_text == parsed_whole.fingerprint_text
    assert parsed.body == parsed_whole.body
    # What the worker gets, byte for byte (a history normalization changed: kept encoded).
    assert encode_body(parsed.body) == orjson.dumps(dict(parsed_whole.body))
    assert (parsed.unchanged, parsed.prompt_chars, parsed.model, parsed.stream,
            parsed.max_tokens, parsed.cache_salt) == (
        parsed_whole.unchanged, parsed_whole.prompt_chars, parsed_whole.model,
        parsed_whole.stream, parsed_whole.max_tokens, parsed_whole.cache_salt)
    return found


def ends(histories: ChatHistories) -> list[int]:
    """Where the remembered histories end in their bodies."""
    return [entry.end for entry in histories._store]


def dumps(body: dict[str, Any], style: str = "compact") -> bytes:
    if style == "spaced":  # the standard library's default separators
        return json.dumps(body).encode()
    return orjson.dumps(body)


@pytest.mark.parametrize("style", ["compact", "spaced"])
@pytest.mark.parametrize("order", ["messages first", "model first", "tools after"])
def test_each_turn_is_decoded_from_its_new_messages_on(style: str, order: str) -> None:
    gateway = Gateway()
    tools = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    found_at = []
    for n in range(200, 401, 20):
        messages = [*HISTORY[:n], {"role": "user", "content": f"question {n}"}]
        if order == "messages first":
            body = {"messages": messages, "model": "m", "max_tokens": 8}
        elif order == "model first":
            body = {"model": "m", "tools": tools, "messages": messages, "stream": False}
        else:
            body = {"model": "m", "messages": messages, "tools": tools, "temperature": 0.5}
        found = check_same(gateway, dumps(body, style))
        found_at.append(found is not None)
    assert found_at == [False] + [True] * 10
    assert len(gateway.histories) == 1  # each turn replaced the entry it was joined to
    assert gateway.histories.hits == 10


def test_the_same_body_again_is_found_and_keeps_one_entry() -> None:
    gateway = Gateway()
    raw = orjson.dumps({"model": "m", "messages": HISTORY})
    assert check_same(gateway, raw) is None
    assert check_same(gateway, raw) is not None
    assert check_same(gateway, raw) is not None
    assert len(gateway.histories) == 1


def test_normalization_is_kept_for_the_history_and_done_for_new_messages() -> None:
    gateway = Gateway()
    ragged = [dict(m, content=m["content"].replace("; ", "  \n") + "\n")
              if m["role"] == "tool" else m for m in HISTORY[:300]]
    first = orjson.dumps({"model": "m", "messages": ragged})
    assert check_same(gateway, first) is None
    clean_tail = HISTORY[300:320]
    found = check_same(gateway, orjson.dumps({"model": "m", "messages": ragged + clean_tail}))
    assert found is not None
    assert not found.history.unchanged
    assert found.history.encoded is not None  # the worker's JSON of the normalized history
    for more in (10, 11, 40):  # later turns: the encoded history grows with them
        longer = ragged + HISTORY[300:320 + more]
        assert check_same(gateway, orjson.dumps({"model": "m", "messages": longer})) is not None
    # The body's own text holding the mark the encoding stands the messages for.
    marked = {"model": "m", "messages": ragged, "user": "\x00messages"}
    check_same(gateway, orjson.dumps(marked))
    # A history normalization left alone, and a new message it changes.
    gateway = Gateway()
    check_same(gateway, orjson.dumps({"model": "m", "messages": HISTORY[:300]}))
    found = check_same(gateway, orjson.dumps({"model": "m", "messages": [
        *HISTORY[:300], {"role": "user", "content": "trailing  \nspaces\u00a0here  "}]}))
    assert found is not None
    assert found.history.unchanged


def test_a_short_chat_is_not_remembered() -> None:
    gateway = Gateway()
    raw = orjson.dumps({"model": "m", "messages": turns(20)})
    assert len(parse_chat(decode_json_object(raw), OPTS).fingerprint_text) < HISTORY_MIN_CHARS
    check_same(gateway, raw)
    assert len(gateway.histories) == 0


def test_an_edit_inside_the_history_is_not_joined() -> None:
    gateway = Gateway()
    check_same(gateway, orjson.dumps({"model": "m", "messages": HISTORY[:300]}))
    edited = [dict(m) for m in HISTORY[:300]]
    edited[150]["content"] = "edited"
    assert check_same(gateway, orjson.dumps({"model": "m", "messages": edited})) is None


def test_tenants_and_options_do_not_share_entries() -> None:
    histories = ChatHistories(min_bytes=1024)
    acme, globex = Gateway(histories, "acme"), Gateway(histories, "globex")
    raw = orjson.dumps({"model": "m", "messages": HISTORY})
    check_same(acme, raw)
    assert check_same(globex, raw) is None
    assert check_same(acme, raw) is not None
    assert histories.seed("acme", OPTS) != histories.seed(
        "acme", NormalizeOptions(line_trailing_whitespace=False))


def test_a_cache_salt_is_never_crossed() -> None:
    gateway = Gateway()
    # A salt before the messages is part of the bytes the entry is found by.
    check_same(gateway, orjson.dumps({"cache_salt": "a", "model": "m", "messages": HISTORY}))
    assert check_same(gateway, orjson.dumps(
        {"cache_salt": "b", "model": "m", "messages": HISTORY})) is None
    # A salt after the messages: such a body is not remembered...
    gateway = Gateway()
    check_same(gateway, orjson.dumps({"model": "m", "messages": HISTORY, "cache_salt": "a"}))
    assert len(gateway.histories) == 0
    # ...and a body that adds one after a remembered history is decoded whole.
    check_same(gateway, orjson.dumps({"model": "m", "messages": HISTORY}))
    assert check_same(gateway, orjson.dumps(
        {"model": "m", "messages": HISTORY, "cache_salt": "b"})) is None


BASE = orjson.dumps({"model": "m", "messages": HISTORY[:300]})


@pytest.mark.parametrize("tail", [
    # the rest of the body after the first 299 messages, as bytes
    b'{"role":"user","content":"hi"}],"model":"n"}',  # a key before the messages again
    b'{"role":"user","content":"hi"}],"messages":[]}',  # the messages again
    b'{"role":"user","content":"hi"}],"\\u0000m":[1]}',  # the seam's own key
    b'{"role":"user","content":"hi"}],"x":{"\\u0000m":[1]}}',
    # the seam's key spelled otherwise: a NUL has one escape, its other characters many
    b'{"role":"user","content":"hi"}],"\\u0000\\u006d":[1,{"role":"user","content":"x"}]}',
    b'{"role":"user","content":"hi"}],"\\u0000\\u006D":[1,{"role":"user","content":"x"}]}',
    b'{"role":"user","content":"hi"}]}  \n',
    b'{"role":"user","content":"hi"}',  # cut short
    b'{"role":"user","content":"hi"}]}]',  # more after the body
    b'{"role":"user","content":"hi"}],"max_tokens":0}',  # invalid field
    b'{"role":"robot","content":"hi"}]}',  # invalid message
    b'{"role":"user","content":"\xff"}]}',  # not UTF-8
    b'{"role":"user","content":"hi"},{}]}',
    b'"text"]}',
    b']}',
    b'{"role":"user","content":"hi"}],"x":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    + b"}",  # as deep as a body may be
    b'{"role":"user","content":"hi"}],"x":' + b"[" * (MAX_JSON_DEPTH + 1)
    + b"]" * (MAX_JSON_DEPTH + 1) + b"}",  # deeper
])
def test_any_rest_decodes_as_the_whole_body_does(tail: bytes) -> None:
    gateway = Gateway()
    check_same(gateway, BASE)
    [end] = ends(gateway.histories)
    assert BASE[end:].startswith(b'{"role"')
    check_same(gateway, BASE[:end] + tail)
    check_same(gateway, BASE)  # the entry still serves its own chat


@pytest.mark.parametrize("body", [
    # The last message's first key also ends a later key's array, repeated after it.
    b'{"model":"m","messages":[%s,{"role":"user","content":"q"}],'
    b'"x":[{"role":"user","content":"q"}],"x":5}',
    # ... or repeating a key before the messages.
    b'{"x":1,"model":"m","messages":[%s,{"role":"user","content":"q"}],'
    b'"x":[{"role":"user","content":"q"}]}',
    # Two "messages" keys: the last wins.
    b'{"model":"m","messages":[{"role":"user","content":"a"}],'
    b'"messages":[%s,{"role":"user","content":"q"}]}',
    b'{"model":"m","messages":[%s,{"role":"user","content":"q"}],'
    b'"messages":[%s,{"role":"user","content":"q"}]}',
    # The first key not where the message begins (whitespace), or keys in another order.
    b'{"model":"m","messages":[%s,{ "role":"user","content":"q"}]}',
    b'{"model":"m","messages":[%s,{"content":"q","role":"user"}]}',
])
def test_bodies_built_to_mislead_the_end_are_decoded_right(body: bytes) -> None:
    history = b",".join(orjson.dumps(m) for m in HISTORY[:300])
    raw = body.replace(b"%s", history)
    gateway = Gateway()
    check_same(gateway, raw)
    for end in ends(gateway.histories):
        for tail in (b'{"role":"user","content":"new"}]}',
                     b'{"role":"user","content":"new"}],"x":[]}',
                     b'{"role":"user","content":"new"}]],"y":2}',
                     b'{"role":"user","content":"new"}]}]}',
                     raw[end:]):
            check_same(gateway, raw[:end] + tail)


def test_entries_are_bounded_by_the_bytes_they_stand_for() -> None:
    raw = orjson.dumps({"model": "m", "messages": HISTORY})
    histories = ChatHistories(max_bytes=3 * len(raw), min_bytes=1024)
    chats = [Gateway(histories, f"tenant {i}") for i in range(5)]
    for chat in chats:
        check_same(chat, raw)
    assert len(histories) == 3  # the two seen least recently went
    assert check_same(chats[0], raw) is None
    assert check_same(chats[4], raw) is not None


@pytest.mark.parametrize("rest", [
    b'{"role":"user","content":"q"}],"x":[{"role":"user","content":"q"}],"x":5}',
    b'{"role":"user","content":"q"}],"y":[{"role":"user","content":"q"},[{"role":"user"}]]}',
    b'{"role":"user","content":"q"}],"x":[{"role":"user","content":"q"}]}',
    b'{"role":"user","content":"q"}, {"role":"tool","content":"r"},'
    b'{ "role":"user","content":"s"}]}',
])
def test_a_joined_body_built_to_mislead_its_own_end_is_decoded_right(rest: bytes) -> None:
    gateway = Gateway()
    check_same(gateway, BASE)
    assert BASE.endswith(b"]}")
    joined = BASE[:-2] + b"," + rest  # the first body's messages, and more
    assert check_same(gateway, joined) is not None  # joined to the first body
    for later in ends(gateway.histories):
        for tail in (b'{"role":"user","content":"new"}]}',
                     b'{"role":"user","content":"new"}],"x":[]}',
                     b'{"role":"user","content":"new"}]],"y":2}',
                     joined[later:]):
            check_same(gateway, joined[:later] + tail)
