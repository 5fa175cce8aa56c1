"""Tests for gateway.openai_schema: validation errors, JSON decoding, forwarded bodies."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.normalize import NormalizeOptions, normalize_messages, render_chat
from gateway.openai_schema import (
    _WALK_BUDGET,
    _WALK_FROM_BYTES,
    MAX_JSON_DEPTH,
    ClientJSON,
    ParsedRequest,
    _nests_deeper,
    decode_json_object,
    encode_body,
    forwarded_body,
    parse_chat,
    parse_completion,
    too_deep,
    with_fields,
)

OPTS = NormalizeOptions()
Parser = Callable[[dict[str, Any], NormalizeOptions], ParsedRequest]

COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hello"}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    body.update(changes)
    return body


def _without(base: dict[str, Any], key: str) -> dict[str, Any]:
    body = copy.deepcopy(base)
    del body[key]
    return body


def _msg(message: Any) -> dict[str, Any]:
    return _with(CHAT, messages=[message])


COMMON_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("model-not-string", {"model": 7}, "model"),
    ("model-empty", {"model": ""}, "model"),
    ("model-list", {"model": ["m"]}, "model"),
    ("stream-not-bool", {"stream": "true"}, "stream"),
    ("stream-int", {"stream": 1}, "stream"),
    ("max_tokens-0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens-negative", {"max_tokens": -5}, "max_tokens"),
    ("max_tokens-string", {"max_tokens": "16"}, "max_tokens"),
    ("max_tokens-bool", {"max_tokens": True}, "max_tokens"),
    ("max_tokens-float", {"max_tokens": 1.5}, "max_tokens"),
    ("max_completion_tokens-0", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("temperature-string", {"temperature": "0.7"}, "temperature"),
    ("temperature-bool", {"temperature": False}, "temperature"),
    ("top_p-string", {"top_p": "1"}, "top_p"),
    ("presence_penalty-list", {"presence_penalty": [0]}, "presence_penalty"),
    ("frequency_penalty-string", {"frequency_penalty": "x"}, "frequency_penalty"),
    ("n-0", {"n": 0}, "n"),
    ("n-string", {"n": "2"}, "n"),
    ("n-bool", {"n": True}, "n"),
    ("cache_salt-number", {"cache_salt": 42}, "cache_salt"),
    ("stream_options-not-object", {"stream_options": True}, "stream_options"),
    ("stream_options-list", {"stream_options": [{"include_usage": True}]}, "stream_options"),
]


@pytest.mark.parametrize(
    ("parser", "body", "param"),
    [
        *(
            pytest.param(parse_completion, _with(COMPLETION, **changes), param, id=f"cmpl-{name}")
            for name, changes, param in COMMON_BAD
        ),
        *(
            pytest.param(parse_chat, _with(CHAT, **changes), param, id=f"chat-{name}")
            for name, changes, param in COMMON_BAD
        ),
        pytest.param(parse_completion, _without(COMPLETION, "model"), "model",
                     id="cmpl-missing-model"),
        pytest.param(parse_chat, _without(CHAT, "model"), "model", id="chat-missing-model"),
        pytest.param(parse_completion, _with(COMPLETION, model=None), "model",
                     id="cmpl-model-null"),
        # -- completions: prompt --
        pytest.param(parse_completion, _without(COMPLETION, "prompt"), "prompt",
                     id="missing-prompt"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=None), "prompt",
                     id="prompt-null"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=42), "prompt",
                     id="prompt-number"),
        pytest.param(parse_completion, _with(COMPLETION, prompt={"text": "x"}), "prompt",
                     id="prompt-object"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=[]), "prompt",
                     id="prompt-empty-list"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=["a", 1]), "prompt",
                     id="prompt-mixed-list"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=[1, -2]), "prompt",
                     id="prompt-negative-token"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=[1, True]), "prompt",
                     id="prompt-bool-token"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=[[1, 2], []]), "prompt",
                     id="prompt-empty-token-list"),
        pytest.param(parse_completion, _with(COMPLETION, prompt=[[1, 2], "a"]), "prompt",
                     id="prompt-token-lists-mixed"),
        # -- chat: messages --
        pytest.param(parse_chat, _without(CHAT, "messages"), "messages",
                     id="missing-messages"),
        pytest.param(parse_chat, _with(CHAT, messages=None), "messages", id="messages-null"),
        pytest.param(parse_chat, _with(CHAT, messages={"role": "user", "content": "x"}),
                     "messages", id="messages-not-list"),
        pytest.param(parse_chat, _with(CHAT, messages="hi"), "messages",
                     id="messages-string"),
        pytest.param(parse_chat, _with(CHAT, messages=[]), "messages", id="messages-empty"),
        pytest.param(parse_chat, _msg("hi"), "messages[0]", id="message-not-object"),
        pytest.param(parse_chat, _with(CHAT, messages=[{"role": "user", "content": "a"}, 7]),
                     "messages[1]", id="second-message-not-object"),
        pytest.param(parse_chat, _msg({"role": "robot", "content": "x"}), "messages[0].role",
                     id="bad-role"),
        pytest.param(parse_chat, _msg({"content": "x"}), "messages[0].role",
                     id="missing-role"),
        pytest.param(parse_chat, _msg({"role": "user", "content": 5}), "messages[0].content",
                     id="content-number"),
        pytest.param(parse_chat, _msg({"role": "user", "content": {"type": "text"}}),
                     "messages[0].content", id="content-object"),
        pytest.param(parse_chat, _msg({"role": "user"}), "messages[0].content",
                     id="content-missing"),
        pytest.param(parse_chat, _msg({"role": "assistant", "content": None}),
                     "messages[0].content", id="assistant-null-content-no-tool-calls"),
        pytest.param(parse_chat, _msg({"role": "user", "content": [{"type": "text"}]}),
                     "messages[0].content[0].text", id="text-part-without-text"),
        pytest.param(parse_chat,
                     _msg({"role": "user", "content": [{"type": "text", "text": 3}]}),
                     "messages[0].content[0].text", id="text-part-text-number"),
        pytest.param(parse_chat, _msg({"role": "user", "content": ["raw"]}),
                     "messages[0].content[0]", id="part-not-object"),
        pytest.param(parse_chat,
                     _msg({"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"text": "b"}]}),
                     "messages[0].content[1]", id="part-without-type"),
        pytest.param(parse_chat, _msg({"role": "user", "content": "x", "name": 3}),
                     "messages[0].name", id="name-not-string"),
        pytest.param(parse_chat, _with(CHAT, tools={"type": "function"}), "tools",
                     id="tools-not-list"),
    ],
)
def test_bad_bodies(parser: Parser, body: dict[str, Any], param: str) -> None:
    original = copy.deepcopy(body)
    with pytest.raises(InvalidRequest) as info:
        parser(body, OPTS)
    err = info.value
    assert err.param == param
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.body()["error"]["param"] == param
    assert body == original


@pytest.mark.parametrize(
    ("parser", "body", "param"),
    [
        pytest.param(parse_completion, {"prompt": "x"}, "model", id="model"),
        pytest.param(parse_completion, {"model": "m"}, "prompt", id="prompt"),
        pytest.param(parse_chat, {"model": "m"}, "messages", id="messages"),
    ],
)
def test_missing_required_parameter_code(
    parser: Parser, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parser(body, OPTS)
    assert info.value.param == param
    assert info.value.code == "missing_required_parameter"


def _nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


# -- decode_json_object ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"{", id="truncated"),
        pytest.param(b"{'model': 'm'}", id="single-quotes"),
        pytest.param(b'{"model": "m",}', id="trailing-comma"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'[{"model": "m"}]', id="array-of-object"),
        pytest.param(b'"text"', id="string"),
        pytest.param(b"42", id="number"),
        pytest.param(b"null", id="null"),
        pytest.param(b'{"model": "\xff\xfe"}', id="invalid-utf8"),
        pytest.param(b"\xc3\x28", id="invalid-utf8-sequence"),
        pytest.param(b'{"a": ' + b"[" * 254 + b"]" * 254 + b"}", id="255-levels"),
        pytest.param(b'{"a": ' + b'[{"b": ' * 127 + b"1" + b"}]" * 127 + b"}",
                     id="255-mixed-levels"),
    ],
)
def test_decode_json_object_rejects(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_json_object(raw)
    assert info.value.code == "invalid_json"
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(b"{}", {}, id="empty-object"),
        pytest.param(b' {"model": "m", "n": 1} ', {"model": "m", "n": 1}, id="whitespace"),
        pytest.param('{"p": "caf\u00e9"}'.encode(), {"p": "caf\u00e9"}, id="utf8"),
        pytest.param(b'{"p": "\\u00a0"}', {"p": "\u00a0"}, id="json-escape"),
        pytest.param(b'{"a": ' + b"[" * 253 + b"]" * 253 + b"}",
                     {"a": _nested_lists(253)}, id="254-levels"),
        pytest.param(b'{"messages": [' + b", ".join([b'{"role": "user", "content": "x"}'] * 300)
                     + b"]}", {"messages": [{"role": "user", "content": "x"}] * 300},
                     id="many-messages"),
        pytest.param(b'{"a": [' + b"[], " * 500 + b'{}], "p": "' + b"{[" * 500 + b'"}',
                     {"a": [[]] * 500 + [{}], "p": "{[" * 500}, id="many-shallow-brackets"),
    ],
)
def test_decode_json_object_accepts(raw: bytes, expected: dict[str, Any]) -> None:
    assert decode_json_object(raw) == expected


# -- good bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "forwarded", "text"),
    [
        pytest.param("Hello\u00a0world\u200b \r\n", "Hello world", "Hello world", id="string"),
        pytest.param("", "", "", id="empty-string"),
        pytest.param(["a\u00a0b  ", "c\r\nd"], ["a b", "c\nd"], "a b", id="list-of-strings"),
        pytest.param([1, 2, 3], [1, 2, 3], "1 2 3", id="token-ids"),
        pytest.param([[4, 5], [6]], [[4, 5], [6]], "4 5", id="token-id-lists"),
    ],
)
def test_parse_completion_good(prompt: Any, forwarded: Any, text: str) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "stream": True,
            "cache_salt": "salt", "vendor_ext": {"x": [1]}, "seed": 3}
    original = copy.deepcopy(body)
    parsed = parse_completion(body, OPTS)
    assert parsed.model == "m"
    assert parsed.body["prompt"] == forwarded
    assert parsed.fingerprint_text == text
    assert parsed.stream is True
    assert parsed.max_tokens == 16
    assert parsed.cache_salt == "salt"
    assert parsed.body["vendor_ext"] == {"x": [1]}
    assert parsed.body["seed"] == 3
    assert {k: v for k, v in parsed.body.items() if k != "prompt"} == {
        k: v for k, v in original.items() if k != "prompt"
    }
    assert body == original, "the client's body must not be mutated"


def test_parse_completion_normalization_disabled() -> None:
    body = {"model": "m", "prompt": "a\u00a0b  "}
    parsed = parse_completion(body, NormalizeOptions(enabled=False))
    assert parsed.body["prompt"] == "a\u00a0b  "
    assert parsed.fingerprint_text == "a\u00a0b  "


@pytest.mark.parametrize(
    ("extra", "stream", "max_tokens", "salt"),
    [
        pytest.param({}, False, None, "", id="defaults"),
        pytest.param({"stream": None, "cache_salt": None}, False, None, "", id="nulls"),
        pytest.param({"stream": False, "max_tokens": None}, False, None, "", id="explicit"),
        pytest.param({"max_completion_tokens": 7}, False, 7, "", id="max_completion_tokens"),
        pytest.param({"stream": True, "stream_options": {"include_usage": True},
                      "temperature": 0, "top_p": 0.5, "n": 2}, True, None, "", id="options"),
    ],
)
def test_parse_common_fields(
    extra: dict[str, Any], stream: bool, max_tokens: int | None, salt: str
) -> None:
    for parser, base in ((parse_completion, COMPLETION), (parse_chat, CHAT)):
        parsed = parser(_with(base, **extra), OPTS)
        assert parsed.stream is stream
        assert parsed.max_tokens == max_tokens
        assert parsed.cache_salt == salt


CHAT_BODIES: list[Any] = [
    pytest.param(
        [{"role": "system", "content": "Be terse.\u00a0\r\n"},
         {"role": "user", "content": "What\u200b is 2+2?  "}],
        None,
        id="strings",
    ),
    pytest.param(
        [{"role": "user", "content": [{"type": "text", "text": "Look\u00a0at this "},
                                      {"type": "image_url", "image_url": {"url": "u "}}]}],
        None,
        id="parts",
    ),
    pytest.param(
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "get", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny\n"}],
        [{"type": "function", "function": {"name": "get", "parameters": {}}}],
        id="tools",
    ),
    pytest.param(
        [{"role": "developer", "content": "x", "name": "ops"},
         {"role": "user", "content": ""}],
        None,
        id="developer-and-empty-content",
    ),
]


@pytest.mark.parametrize(("messages", "tools"), CHAT_BODIES)
def test_parse_chat_good(messages: list[dict[str, Any]], tools: list[Any] | None) -> None:
    body: dict[str, Any] = {"model": "m", "messages": messages, "user": "u1",
                            "vendor_ext": {"priority": 1}}
    if tools is not None:
        body["tools"] = tools
    original = copy.deepcopy(body)
    parsed = parse_chat(body, OPTS)
    normalized = normalize_messages(original["messages"], OPTS)
    assert parsed.body["messages"] == normalized
    assert parsed.fingerprint_text == render_chat(normalized, tools)
    assert parsed.body["user"] == "u1"
    assert parsed.body["vendor_ext"] == {"priority": 1}
    if tools is not None:
        assert parsed.body["tools"] == tools
    assert body == original, "the client's body must not be mutated"
    json.dumps(parsed.body)  # the forwarded body is still plain JSON


def test_parse_chat_normalizes_forwarded_content() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a\u00a0b\u200b \r\n"}]}
    parsed = parse_chat(body, OPTS)
    assert parsed.body["messages"] == [{"role": "user", "content": "a b"}]
    assert "\u00a0" not in parsed.fingerprint_text


def test_parse_chat_same_conversation_same_fingerprint_text() -> None:
    a = {"model": "m", "messages": [{"role": "user", "content": "hi\u00a0there"}]}
    b = {"messages": [{"content": [{"type": "text", "text": "hi there  "}], "role": "user"}],
         "model": "m"}
    assert parse_chat(a, OPTS).fingerprint_text == parse_chat(b, OPTS).fingerprint_text


@pytest.mark.parametrize(
    ("parser", "body", "unchanged"),
    [
        pytest.param(parse_chat, {"model": "m", "messages": [
            {"role": "user", "content": "plain text"}]}, True, id="chat-clean"),
        pytest.param(parse_chat, {"model": "m", "messages": [
            {"role": "user", "content": "non\u00a0breaking"}]}, False, id="chat-nbsp"),
        pytest.param(parse_chat, {"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "trailing  "}]}]}, False,
            id="chat-parts-trailing"),
        pytest.param(parse_completion, {"model": "m", "prompt": "clean"}, True,
                     id="completion-clean"),
        pytest.param(parse_completion, {"model": "m", "prompt": "crlf\r\nline"}, False,
                     id="completion-crlf"),
        pytest.param(parse_completion, {"model": "m", "prompt": [1, 2, 3]}, True,
                     id="completion-token-ids"),
    ],
)
def test_unchanged_means_the_client_bytes_can_be_forwarded(
    parser: Parser, body: dict[str, Any], unchanged: bool
) -> None:
    raw = json.dumps(body).encode()
    parsed = parser(decode_json_object(raw), NormalizeOptions())
    assert parsed.unchanged is unchanged
    # Forwarding the client's bytes is only allowed where they decode to the forwarded body.
    assert (json.loads(raw) == parsed.body) is unchanged


def test_forwarded_body_is_the_client_bytes_only_when_unchanged() -> None:
    clean = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "x_ext": 1.50}'
    parsed = parse_chat(decode_json_object(clean), NormalizeOptions())
    body = forwarded_body(parsed, clean)
    assert encode_body(body) == clean  # byte for byte, spacing and number format included
    salted = {**body, "cache_salt": "tenant"}  # what a backend that edits the body does
    assert json.loads(encode_body(salted)) == {**json.loads(clean), "cache_salt": "tenant"}

    dirty = '{"model": "m", "messages": [{"role": "user", "content": "hi\u00a0there "}]}'
    parsed = parse_chat(decode_json_object(dirty.encode()), NormalizeOptions())
    body = forwarded_body(parsed, dirty.encode())
    assert not isinstance(body, ClientJSON)
    assert json.loads(encode_body(body))["messages"][0]["content"] == "hi there"


@pytest.mark.parametrize("raw", [
    b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "x_ext": 1.50}',
    b' \n{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}\n',
])
def test_fields_set_on_a_client_body_keep_its_bytes(raw: bytes) -> None:
    body = forwarded_body(parse_chat(decode_json_object(raw), NormalizeOptions()), raw)
    fields = {"cache_salt": "t\u00e9nant/\"x\"", "stream_options": {"include_usage": True}}
    edited = with_fields(body, fields)
    assert isinstance(edited, ClientJSON)
    assert edited == {**json.loads(raw), **fields}
    assert json.loads(encode_body(edited)) == edited
    assert raw.strip()[1:] in encode_body(edited)  # the client's bytes, not encoded again
    assert encode_body(body) == raw  # the client's body is left as it was


def test_a_field_the_client_set_is_replaced_by_encoding_the_body_again() -> None:
    raw = b'{"model":"m","cache_salt":"mine","messages":[{"role":"user","content":"hi"}]}'
    body = forwarded_body(parse_chat(decode_json_object(raw), NormalizeOptions()), raw)
    edited = with_fields(body, {"cache_salt": "tenant"})
    assert not isinstance(edited, ClientJSON)  # never the same key twice in one body
    assert json.loads(encode_body(edited))["cache_salt"] == "tenant"
    plain = with_fields({"model": "m"}, {"cache_salt": "t"})
    assert not isinstance(plain, ClientJSON)
    assert plain == {"model": "m", "cache_salt": "t"}


class _Unread(bytes):
    """Bytes that fail the test when searched."""

    def find(self, *args: Any, **kwargs: Any) -> int:
        raise AssertionError("the body's bytes were read")


class _Searched(bytes):
    """Bytes that count the searches made in them."""

    searches = 0

    def find(self, *args: Any, **kwargs: Any) -> int:
        self.searches += 1
        return super().find(*args, **kwargs)


def _nested(levels: int) -> dict[str, object]:
    inner: list[object] = []
    for _ in range(levels - 1):
        inner = [inner]
    return {"prompt": "hi", "x": inner}


@pytest.mark.parametrize("levels", [1, 253, 254, 255, 256])
def test_the_depth_walk_agrees_with_what_orjson_encodes(levels: int) -> None:
    """The walk calls too deep exactly the bodies orjson refuses to encode."""
    value = _nested(levels)
    try:
        orjson.dumps(value)
        refused = False
    except orjson.JSONEncodeError:
        refused = True
    assert _nests_deeper(value, MAX_JSON_DEPTH, budget=10_000) is refused


def test_a_short_prompt_of_code_is_walked_not_searched_bracket_by_bracket() -> None:
    """A short completions body whose prompt holds hundreds of brackets is decided by its
    few containers after a bounded search, not one search per bracket in its text."""
    body = {"model": "m", "prompt": "if (a) { b[c] = {d: [e]}; }\n" * 300}
    raw = _Searched(orjson.dumps(body))
    assert too_deep(raw, body) is False
    assert raw.searches <= 2 * (_WALK_BUDGET + 1)


@pytest.mark.parametrize("levels", [_WALK_BUDGET, _WALK_BUDGET + 1, 253, 254, 255])
def test_short_bodies_are_refused_exactly_past_the_depth_orjson_encodes(levels: int) -> None:
    """Short bodies, of few and of many containers, at and around the limit: too deep
    exactly when orjson refuses to encode them."""
    for extra in (b"", b',"m":[' + b",".join([b'{"c":"x"}'] * 40) + b"]"):
        raw = b'{"x":' + b"[" * (levels - 1) + b"]" * (levels - 1) + extra + b"}"
        value = orjson.loads(raw)
        try:
            orjson.dumps(value)
            refused = False
        except orjson.JSONEncodeError:
            refused = True
        assert len(raw) <= _WALK_FROM_BYTES
        assert too_deep(raw, value) is refused


def test_a_body_of_few_containers_is_decided_without_its_bytes() -> None:
    """A long completions body's depth is decided by walking its few containers (its bytes
    are not read); a long body of many containers is decided from its bytes, and a deep one
    among them is refused."""
    long = {"model": "m", "prompt": "text " * 20_000}
    assert too_deep(_Unread(orjson.dumps(long)), long) is False
    wide = {"messages": [{"role": "user", "content": "hi " * 1000}] * 100}
    assert _nests_deeper(wide, MAX_JSON_DEPTH, budget=16) is None
    assert too_deep(orjson.dumps(wide), wide) is False
    messages = b",".join([b'{"role":"user","content":"' + b"hi " * 1000 + b'"}'] * 100)
    raw = (b'{"messages":[' + messages + b'],"x":' + b"[" * (MAX_JSON_DEPTH + 1)
           + b"]" * (MAX_JSON_DEPTH + 1) + b"}")
    assert too_deep(raw, orjson.loads(raw)) is True
