"""Long completions prompts decoded from what they add on (gateway.prompt_histories): the body
and the errors are those of decoding the whole body, on every shape of body."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import (
    MAX_JSON_DEPTH,
    ParsedRequest,
    decode_json_object,
    encode_body,
    forwarded_body,
    parse_completion,
)
from gateway.prompt_histories import KnownPrompt, PromptHistories, _encodes_string

OPTS = NormalizeOptions()


def context(lines: int = 1200) -> str:
    """An agent's context as one text: lines of code and prose, quotes and a typeset dash."""
    out = []
    for i in range(lines):
        if i % 5 == 0:
            out.append(f'    path = "src/f{i}.py"  # a \\ backslash and a "quote"')
        elif i % 7 == 0:
            out.append(f"Step {i} \u2014 read \u201cfile {i}\u201d \U0001f600")
        else:
            out.append(f"line {i} of the context, with words enough to fill it")
    return "\n".join(out)


PROMPT = context()  # about 60k characters: a long prompt


class Gateway:
    """What the gateway's completions route does with a body (gateway.api): decode with the
    memo, parse with what it found, remember what the parse kept."""

    def __init__(self, histories: PromptHistories | None = None, tenant: str = "t",
                 opts: NormalizeOptions = OPTS) -> None:
        self.histories = histories if histories is not None else PromptHistories(min_bytes=1024)
        self.opts = opts
        self.seed = self.histories.seed(tenant, opts)

    def send(self, raw: bytes) -> tuple[dict[str, Any], ParsedRequest, KnownPrompt | None]:
        body, found = self.histories.decode(raw, self.seed)
        parsed = parse_completion(body, self.opts, None,
                                  found.normal if found is not None else None,
                                  keep_history=True)
        self.histories.remember(raw, self.seed, body, found, parsed.normal)
        return body, parsed, found


def whole(raw: bytes, opts: NormalizeOptions) -> tuple[dict[str, Any], ParsedRequest]:
    body = decode_json_object(raw)
    return body, parse_completion(body, opts)


def check_same(gateway: Gateway, raw: bytes) -> KnownPrompt | None:
    """``raw`` through the memo gives what decoding and parsing it whole gives."""
    try:
        expected, parsed_whole = whole(raw, gateway.opts)
    except InvalidRequest as exc:
        error = exc
    else:
        body, parsed, found = gateway.send(raw)
        assert body == expected
        assert list(body) == list(expected)  # the keys in the body's order
        assert parsed.fingerprint_text == parsed_whole.fingerprint_text
        assert parsed.body == parsed_whole.body
        assert parsed.unchanged == parsed_whole.unchanged
        assert encode_body(forwarded_body(parsed, raw)) == encode_body(
            forwarded_body(parsed_whole, raw))  # what the worker gets, byte for byte
        return found
    with pytest.raises(InvalidRequest) as raised:
        gateway.send(raw)
    assert (str(raised.value), raised.value.param) == (str(error), error.param)
    return None


def ends(histories: PromptHistories) -> list[int]:
    """Where the remembered prompts close in their bodies."""
    return [entry.end for entry in histories._store]


def dumps(body: dict[str, Any], style: str) -> bytes:
    if style == "spaced":  # the standard library's defaults: spaces, every non-ASCII escaped
        return json.dumps(body).encode()
    return orjson.dumps(body)  # compact, UTF-8


@pytest.mark.parametrize("style", ["compact", "spaced"])
@pytest.mark.parametrize("order", ["prompt last", "prompt second", "prompt first"])
def test_each_turn_is_decoded_from_what_it_adds(style: str, order: str) -> None:
    gateway = Gateway()

    def body(prompt: str) -> bytes:
        fields: dict[str, Any] = {"model": "m", "max_tokens": 4, "temperature": 0}
        if order == "prompt last":
            return dumps({**fields, "prompt": prompt}, style)
        if order == "prompt second":  # as the openai client writes it
            return dumps({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": False},
                         style)
        return dumps({"prompt": prompt, **fields}, style)

    prompt = PROMPT
    assert check_same(gateway, body(prompt)) is None  # a first body: decoded whole
    for turn in range(6):
        # What each turn adds ends in every way a string can be cut before: a quote, a
        # backslash, an escaped control character, a character outside the BMP.
        prompt += ["\nok \"done\"", "\n\\", "\tand\n", "\U0001f600", " \u201cq\u201d", "."][turn]
        assert check_same(gateway, body(prompt)) is not None, turn
        assert len(gateway.histories) == 1  # each turn replaces the entry it was joined to
    assert gateway.histories.hits == 6


def test_the_same_body_again_is_found_and_keeps_one_entry() -> None:
    gateway = Gateway()
    raw = orjson.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 1})
    assert check_same(gateway, raw) is None
    assert check_same(gateway, raw) is not None
    assert check_same(gateway, raw) is not None
    assert (len(gateway.histories), gateway.histories.hits) == (1, 2)


def test_short_bodies_and_prompts_that_are_not_text_are_not_remembered() -> None:
    gateway = Gateway(PromptHistories(min_bytes=1 << 20))
    check_same(gateway, orjson.dumps({"model": "m", "prompt": PROMPT}))
    gateway = Gateway()
    check_same(gateway, orjson.dumps({"model": "m", "prompt": [PROMPT]}))
    check_same(gateway, orjson.dumps({"model": "m", "prompt": list(range(20000))}))
    assert len(gateway.histories) == 0


def test_an_edit_inside_the_prompt_is_not_joined() -> None:
    gateway = Gateway()
    check_same(gateway, orjson.dumps({"model": "m", "prompt": PROMPT}))
    edited = PROMPT[:40000] + "X" + PROMPT[40001:] + " more"
    assert check_same(gateway, orjson.dumps({"model": "m", "prompt": edited})) is None
    # ...nor a prompt that stops short of the last one.
    assert check_same(gateway, orjson.dumps({"model": "m", "prompt": PROMPT[:-1]})) is None


def test_tenants_and_options_do_not_share_entries() -> None:
    histories = PromptHistories(min_bytes=1024)
    acme, globex = Gateway(histories, "acme"), Gateway(histories, "globex")
    check_same(acme, orjson.dumps({"model": "m", "prompt": PROMPT}))
    assert check_same(globex, orjson.dumps({"model": "m", "prompt": PROMPT + "!"})) is None
    assert check_same(acme, orjson.dumps({"model": "m", "prompt": PROMPT + "!"})) is not None
    other = PromptHistories.seed("acme", NormalizeOptions(line_trailing_whitespace=False))
    assert other != acme.seed


BASE = orjson.dumps({"model": "m", "max_tokens": 1, "prompt": PROMPT})


@pytest.mark.parametrize("tail", [
    # the rest of a body after the base's prompt, as bytes
    b' and more"}',
    b'"}  \n',
    b'","stream":true,"stop":["\\n"]}',
    b' and more","model":"n"}',  # a key before the prompt again
    b' and more","prompt":"x"}',  # the prompt again
    b' and more","\\u0000p":"x"}',  # the seam's own key
    b' and more","\\u0000\\u0070":"x"}',  # spelled otherwise
    b' and more \\u0000 a NUL"}',  # a NUL in the text: decoded whole
    b' and more',  # cut short
    b' and more"}]',  # more after the body
    b' and more", "max_tokens": 0}',  # a field a parse would refuse: decoded alike
    b' \xff"}',  # not UTF-8
    b' \\ud800 a lone surrogate"}',
    b'\\',
    b'"',
    b'"}' + b" " * 3,
    b' and more","x":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
    b' and more","x":' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
])
def test_any_rest_decodes_as_the_whole_body_does(tail: bytes) -> None:
    gateway = Gateway()
    check_same(gateway, BASE)
    [end] = ends(gateway.histories)
    assert BASE[end:] == b'"}'
    check_same(gateway, BASE[:end] + tail)
    check_same(gateway, BASE)  # the entry still serves its own prompt


@pytest.mark.parametrize("body", [
    # "prompt" inside a value before the key, or as a key of a nested object.
    b'{"model":"say \\"prompt\\": \\"x","prompt":"%s"}',
    b'{"model":"m","extra":{"prompt":"short"},"prompt":"%s"}',
    b'{"model":"m","a \\"prompt":"x","prompt":"%s"}',
    # Two "prompt" keys: the last wins.
    b'{"model":"m","prompt":"a","prompt":"%s"}',
    b'{"model":"m","prompt":"%s","prompt":"%s"}',
    # The key written with an escape, or spaced out.
    b'{"model":"m","pr\\u006fmpt":"%s"}',
    b'{"model":"m" , "prompt" :\n "%s"}',
])
def test_bodies_built_to_mislead_the_end_are_decoded_right(body: bytes) -> None:
    text = orjson.dumps(PROMPT)[1:-1]
    raw = body.replace(b"%s", text)
    gateway = Gateway()
    check_same(gateway, raw)
    for more in (b" one", b" two"):
        # The next turns: the last prompt string of the body grows.
        cut = raw.rindex(b'"}')
        raw = raw[:cut] + more + raw[cut:]
        check_same(gateway, raw)


@pytest.mark.parametrize("grown", [b" x", b"\xc2\xa0x"])  # plain, or text the rules rewrite
@pytest.mark.parametrize("repeated", [b'"model":"m"', b'"user":"u"'])
def test_a_key_repeated_after_the_prompt_with_the_same_value_is_not_taken_for_it(
    grown: bytes, repeated: bytes
) -> None:
    # The repeated key's value closes the body where a prompt with no keys after it would, and
    # decoded closed there the body is the same object: only a mark added to the string cut
    # there tells that string from the prompt.
    text = orjson.dumps(PROMPT)[1:-1]
    raw = b'{"model":"m","user":"u","max_tokens":4,"prompt":"' + text + b'",' + repeated + b"}"
    gateway = Gateway()
    check_same(gateway, raw)
    cut = raw.rindex(b'"}')
    # The next body grows the repeated value, not the prompt.
    check_same(gateway, raw[:cut] + grown + raw[cut:])


def test_a_misplaced_end_is_evicted_when_checked() -> None:
    # The first "prompt" key belongs to a nested object: the end found from it does not close
    # the body's prompt, which the check on the next turn finds.
    gateway = Gateway()
    text = orjson.dumps(PROMPT)[1:-1]
    # After the prompt, a number written as no common encoder writes it: the end is searched
    # for from the first "prompt" key.
    raw = (b'{"model":"m","extra":{"prompt":"' + text + b'"},"prompt":"' + text
           + b'","temperature":1e0}')
    check_same(gateway, raw)
    assert len(gateway.histories) == 1
    [first] = list(gateway.histories._store)
    end = first.end
    assert raw[end:].startswith(b'"},"prompt"')  # the nested prompt's close
    assert check_same(gateway, raw[:end] + b' x' + raw[end:]) is None
    # The entry failed its check and went; the body decoded whole stands in its place,
    # unchecked, as any first body.
    [entry] = list(gateway.histories._store)
    assert entry is not first
    assert not entry.checked


def test_entries_are_bounded_by_the_bytes_they_stand_for() -> None:
    raw = orjson.dumps({"model": "m", "prompt": PROMPT})
    histories = PromptHistories(max_bytes=3 * len(raw), min_bytes=1024)
    gateway = Gateway(histories)
    for i in range(5):
        check_same(gateway, orjson.dumps({"model": "m", "prompt": f"{i}" + PROMPT}))
    assert len(histories) == 3
    assert histories.held_bytes <= 3 * len(raw)
    # The oldest went first: the first prompt is no longer known, the last is.
    assert check_same(gateway, orjson.dumps({"model": "m", "prompt": "0" + PROMPT + "!"})) is None
    assert check_same(gateway, orjson.dumps({"model": "m", "prompt": "4" + PROMPT + "!"}))


@pytest.mark.parametrize("first", ["normal", "rewritten"])
def test_a_joined_prompt_is_normalized_from_the_last_prompts_last_line(first: str) -> None:
    # Each turn adds what the rules rewrite, or what makes them rewrite the line before: a
    # line ending in spaces, CRLF and a lone CR, a space the rules unify, an invisible
    # character, spaces at the very end, a line of spaces only, text with no newline.
    gateway = Gateway()
    prompt = PROMPT if first == "normal" else PROMPT + "  \nragged line  "
    found = []
    for more in ["\nplain", "  ", "\nnext", " line\u00a0ends\r", "\nafter a CR\r\n",
                 "crlf\u200b and  ", "   ", "\n   \n", "x", "\tq\t"]:
        found.append(check_same(gateway, orjson.dumps({"model": "m", "prompt": prompt})))
        prompt += more
    found.append(check_same(gateway, orjson.dumps({"model": "m", "prompt": prompt})))
    assert found[0] is None
    assert all(f is not None for f in found[1:])  # every later turn joined
    # A first prompt the rules left as it was gives each later turn the rules past it only.
    second = found[1]
    assert second is not None
    assert (second.normal is not None) is (first == "normal")
    assert gateway.histories.hits == len(found) - 1


@pytest.mark.parametrize("opts", [
    NormalizeOptions(line_trailing_whitespace=False),
    NormalizeOptions(trailing_whitespace=False),
    NormalizeOptions(enabled=False),
])
def test_turns_normalize_alike_under_other_options(opts: NormalizeOptions) -> None:
    gateway = Gateway(opts=opts)
    prompt = PROMPT
    for more in ["  \nnext  ", "\r\nb\u00a0 ", "\n\n  "]:
        check_same(gateway, orjson.dumps({"model": "m", "prompt": prompt}))
        prompt += more
    assert check_same(gateway, orjson.dumps({"model": "m", "prompt": prompt})) is not None


def test_a_cache_salt_is_never_crossed() -> None:
    gateway = Gateway()
    # A salt after the prompt: not remembered (a later body could carry another).
    check_same(gateway, orjson.dumps({"model": "m", "prompt": PROMPT, "cache_salt": "a"}))
    assert len(gateway.histories) == 0
    # A salt before it is in the bytes compared: the same salt joins, another does not.
    check_same(gateway, orjson.dumps({"model": "m", "cache_salt": "a", "prompt": PROMPT}))
    assert check_same(gateway, orjson.dumps(
        {"model": "m", "cache_salt": "a", "prompt": PROMPT + "!"})) is not None
    assert check_same(gateway, orjson.dumps(
        {"model": "m", "cache_salt": "b", "prompt": PROMPT + "!!"})) is None
    # ...and a rest that adds a salt is decoded whole.
    check_same(gateway, orjson.dumps({"model": "m", "prompt": PROMPT}))
    assert check_same(gateway, orjson.dumps(
        {"model": "m", "prompt": PROMPT + "?", "cache_salt": "c"})) is None


ODD_TAIL = b'","temperature":1e0}'  # no common encoder writes 1.0 so: the end is searched for


@pytest.mark.parametrize("tail", [b'"}', b'","max_tokens":1}', b'", "max_tokens": 1}',
                                  b'"}\n', ODD_TAIL])
def test_the_end_is_found_whatever_follows_the_prompt(tail: bytes) -> None:
    gateway = Gateway()
    # The prompt ends in a run of backslashes (escaped, an even run before the close).
    prompt = PROMPT + "\\" * 301
    raw = b'{"model":"m","prompt":"' + orjson.dumps(prompt)[1:-1] + tail
    check_same(gateway, raw)
    [end] = ends(gateway.histories)
    assert raw[end:] == tail
    cut = len(raw) - len(tail)
    assert check_same(gateway, raw[:cut] + b"more" + raw[cut:]) is not None


def test_a_prompt_of_escaped_quotes_gives_up_the_search() -> None:
    # Past the earliest possible close, ten thousand escaped quotes: more than the search
    # looks at, so the body is not remembered (and costs no scan per quote).
    gateway = Gateway()
    prompt = "x" * 40_000 + '"' * 20_000
    check_same(gateway, b'{"model":"m","prompt":' + orjson.dumps(prompt)[:-1] + ODD_TAIL)
    assert len(gateway.histories) == 0
    # Written as the client's encoder writes the keys after it, the end is where they begin.
    check_same(gateway, orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}))
    assert len(gateway.histories) == 1


def test_what_a_joined_prompt_adds_must_be_the_bytes_up_to_its_end() -> None:
    # The check on a joined body's end: the bytes from its entry's end to its own decode,
    # as a string's inside, to exactly what the prompt adds.
    assert _encodes_string(b'more \\"q\\" \\u00e9', 'more "q" \u00e9')
    assert not _encodes_string(b'more"', "more")  # past the close
    assert not _encodes_string(b'mor', "more")  # short of it
    assert not _encodes_string(b'more\\', "more\\")  # inside an escape
