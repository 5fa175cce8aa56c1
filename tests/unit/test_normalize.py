"""Table-driven tests for gateway.normalize: normalize_text, normalize_messages, render_chat."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.normal_texts import NormalTexts
from gateway.normal_texts import char_width as _char_width
from gateway.normalize import (
    NormalizeOptions,
    _rewrites,
    _translation_table,
    normalize_content,
    normalize_messages,
    normalize_text,
    prepare,
    render_chat,
)
from gateway.openai_schema import parse_chat

DEFAULT = NormalizeOptions()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("a\u00a0b", "a b", id="nbsp"),
        pytest.param("a\u2009b", "a b", id="thin-space"),
        pytest.param("a\u3000b", "a b", id="ideographic-space"),
        pytest.param("a\u202fb", "a b", id="narrow-nbsp"),
        pytest.param("a\u200bb", "ab", id="zero-width-space"),
        pytest.param("\ufeffhello", "hello", id="bom"),
        pytest.param("co\u00adop", "coop", id="soft-hyphen"),
        pytest.param("a\u2060b", "ab", id="word-joiner"),
        pytest.param("a\u202eb\u202c", "ab", id="bidi-controls"),
        pytest.param("\U0001f468\u200d\U0001f4bb", "\U0001f468\u200d\U0001f4bb", id="zwj-kept"),
        pytest.param("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
                     "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", id="zwnj-kept"),
        pytest.param("a\r\nb\r\nc", "a\nb\nc", id="crlf"),
        pytest.param("a\rb", "a\nb", id="lone-cr"),
        pytest.param("a\r\r\nb", "a\n\nb", id="cr-then-crlf"),
        pytest.param("a\u2028b", "a\nb", id="line-separator"),
        pytest.param("a\u2029b", "a\nb", id="paragraph-separator"),
        pytest.param("hello   ", "hello", id="trailing-spaces"),
        pytest.param("hello\n\n\n", "hello", id="trailing-newlines"),
        pytest.param("hello \t\r\n \n", "hello", id="trailing-mixed"),
        pytest.param("hello\u00a0\u200b", "hello", id="trailing-invisible-and-nbsp"),
        # Indentation stays (the tab); a blank first line loses its spaces (line trim).
        pytest.param("  \n\thello", "\n\thello", id="leading-whitespace-kept"),
        pytest.param("a  b\n\nc", "a  b\n\nc", id="inner-whitespace-kept"),
        pytest.param("plain ASCII text, 123!", "plain ASCII text, 123!", id="ascii-unchanged"),
        pytest.param("caf\u00e9 \u65e5\u672c", "caf\u00e9 \u65e5\u672c", id="non-ascii-letters"),
        pytest.param("", "", id="empty"),
        pytest.param(" \u00a0\u200b\r\n", "", id="only-whitespace"),
    ],
)
def test_normalize_text_defaults(text: str, expected: str) -> None:
    assert normalize_text(text) == expected
    assert normalize_text(text, DEFAULT) == expected


@pytest.mark.parametrize(
    ("opts", "text", "expected"),
    [
        pytest.param(NormalizeOptions(enabled=False), "a\u00a0b\u200b\r\n  ",
                     "a\u00a0b\u200b\r\n  ", id="disabled-leaves-everything"),
        pytest.param(NormalizeOptions(unicode_spaces=False), "a\u00a0b\u3000c\u2028d\u200be",
                     "a\u00a0b\u3000c\u2028de", id="unicode-spaces-off"),
        pytest.param(NormalizeOptions(invisible=False), "a\u200bb\u00adc\ufeff\u00a0d",
                     "a\u200bb\u00adc\ufeff d", id="invisible-off"),
        pytest.param(NormalizeOptions(newlines=False), "a\r\nb\rc\u00a0d",
                     "a\r\nb\rc d", id="newlines-off"),
        pytest.param(NormalizeOptions(trailing_whitespace=False, line_trailing_whitespace=False),
                     "a\u00a0b  \n\n", "a b  \n\n", id="trailing-whitespace-off"),
        pytest.param(NormalizeOptions(trailing_whitespace=False), "a\u00a0b  \n\n",
                     "a b\n\n", id="trailing-off-lines-still-trimmed"),
        pytest.param(NormalizeOptions(trailing_whitespace=False), "a\r\n",
                     "a\n", id="trailing-off-crlf-still-converted"),
        pytest.param(NormalizeOptions(unicode_spaces=False, invisible=False), "a\u00a0\u200bb",
                     "a\u00a0\u200bb", id="spaces-and-invisible-off"),
    ],
)
def test_normalize_text_options(opts: NormalizeOptions, text: str, expected: str) -> None:
    assert normalize_text(text, opts) == expected


def test_normalize_text_is_idempotent() -> None:
    text = "\ufeffa\u00a0b\u200b\r\nc\u2028d  \n"
    once = normalize_text(text)
    assert normalize_text(once) == once


# -- normalize_messages -------------------------------------------------------------------------


def _image_part() -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA\u00a0 "}}


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        pytest.param(
            {"role": "user", "content": "hi\u00a0there  "},
            {"role": "user", "content": "hi there"},
            id="string-content",
        ),
        pytest.param(
            {"role": "user", "content": [{"type": "text", "text": "a\u200bb "}, _image_part()]},
            # The text is not at the end of the content, so its trailing space stays.
            {"role": "user", "content": [{"type": "text", "text": "ab "}, _image_part()]},
            id="image-part-untouched",
        ),
        pytest.param(
            {"role": "user", "content": [{"type": "text", "text": "x ", "cache_control": "ep"}]},
            {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": "ep"}]},
            id="text-part-extra-keys-kept",
        ),
        pytest.param(
            {"role": "user", "content": [{"type": "text", "text": 7}, "raw\u00a0 "]},
            {"role": "user", "content": [{"type": "text", "text": 7}, "raw\u00a0 "]},
            id="malformed-parts-untouched",
        ),
        pytest.param(
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "function": {"arguments": "{\"q\": \"a\u00a0 \"}"}}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "function": {"arguments": "{\"q\": \"a\u00a0 \"}"}}]},
            id="tool-calls-untouched",
        ),
        pytest.param(
            {"role": "user", "name": "bob\u00a0 ", "weird": "x\u200b ", "content": "y "},
            {"role": "user", "name": "bob\u00a0 ", "weird": "x\u200b ", "content": "y"},
            id="other-keys-untouched",
        ),
        pytest.param(
            {"role": "tool", "tool_call_id": "c1"},
            {"role": "tool", "tool_call_id": "c1"},
            id="no-content-key-not-added",
        ),
    ],
)
def test_normalize_messages(message: dict[str, Any], expected: dict[str, Any]) -> None:
    original = copy.deepcopy(message)
    out = normalize_messages([message], DEFAULT)
    assert out == [expected]
    assert message == original, "input must not be mutated"
    assert out[0] is not message


def test_normalize_messages_does_not_mutate_nested_parts() -> None:
    part = {"type": "text", "text": "a\u00a0 "}
    messages = [{"role": "user", "content": [part]}]
    out = normalize_messages(messages, DEFAULT)
    assert part == {"type": "text", "text": "a\u00a0 "}
    assert messages[0]["content"] == [{"type": "text", "text": "a\u00a0 "}]
    assert out[0]["content"] == [{"type": "text", "text": "a"}]


def test_normalize_messages_disabled_is_identity_copy() -> None:
    messages = [{"role": "user", "content": "a\u00a0b  "}]
    out = normalize_messages(messages, NormalizeOptions(enabled=False))
    assert out == messages
    assert out[0] is not messages[0]


@pytest.mark.parametrize(
    ("text", "trim", "expected"),
    [
        pytest.param("def f():  \n    return 1\t\n\nx", True, "def f():\n    return 1\n\nx",
                     id="inner-lines-trimmed"),
        pytest.param("a  \nb", False, "a  \nb", id="option-off-keeps-them"),
        pytest.param("  leading\n  kept", True, "  leading\n  kept", id="indentation-kept"),
        pytest.param("a \u00a0\r\nb", True, "a\nb", id="after-nbsp-and-crlf"),
        pytest.param("a\f \nb", True, "a\f\nb", id="only-spaces-and-tabs"),
    ],
)
def test_line_trailing_whitespace(text: str, trim: bool, expected: str) -> None:
    opts = NormalizeOptions(line_trailing_whitespace=trim)
    assert normalize_text(text, opts) == expected
    if trim and "\r" not in text:  # a re-render with trailing spaces on inner lines
        assert normalize_text(text.replace("\n", " \t \n"), opts) == expected


def test_line_trim_is_linear_on_a_long_run_of_spaces() -> None:
    # A run of spaces that does not end a line is kept, whatever its length.
    text = " " * 200_000 + "x \ny"
    assert normalize_text(text) == " " * 200_000 + "x\ny"


def test_a_line_end_between_text_parts_is_trimmed() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a  "},
                                          {"type": "text", "text": "\nb"}]}]
    plain = [{"role": "user", "content": "a\nb"}]
    assert render_chat(normalize_messages(parts, DEFAULT)) == render_chat(
        normalize_messages(plain, DEFAULT))


def test_split_text_parts_normalize_like_joined_text() -> None:
    joined = [{"role": "user", "content": "Hello world"}]
    split = [{"role": "user", "content": [
        {"type": "text", "text": "Hello "},
        {"type": "text", "text": "world"},
    ]}]
    assert render_chat(normalize_messages(split, DEFAULT)) == render_chat(
        normalize_messages(joined, DEFAULT)
    )


# -- render_chat ----------------------------------------------------------------------------------

BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(
            [{"role": "user", "content": "hi"}],
            [{"content": "hi", "role": "user"}],
            id="key-order",
        ),
        pytest.param(
            [{"role": "user", "content": "hello world"}],
            [{"role": "user", "content": [{"type": "text", "text": "hello "},
                                          {"type": "text", "text": "world"}]}],
            id="split-text-parts-vs-string",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "text", "text": "abc"}]}],
            [{"role": "user", "content": [{"text": "a", "type": "text"},
                                          {"type": "text", "text": "bc"}]}],
            id="split-text-parts-and-part-key-order",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u",
                                                                              "detail": "low"}}]}],
            [{"role": "user", "content": [{"image_url": {"detail": "low", "url": "u"},
                                           "type": "image_url"}]}],
            id="non-text-part-key-order",
        ),
        pytest.param(
            [{"role": "assistant", "content": None,
              "tool_calls": [{"id": "1", "type": "function",
                              "function": {"name": "f", "arguments": "{}"}}]}],
            [{"tool_calls": [{"function": {"arguments": "{}", "name": "f"}, "type": "function",
                              "id": "1"}], "content": None, "role": "assistant"}],
            id="tool-calls-key-order",
        ),
        pytest.param(
            [{"role": "assistant", "content": None}],
            [{"role": "assistant", "content": ""}],
            id="none-content-is-empty",
        ),
        pytest.param(
            [{"role": "user", "content": "x", "name": ""}],
            [{"role": "user", "content": "x"}],
            id="empty-name-ignored",
        ),
    ],
)
def test_render_chat_same_conversation(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert render_chat(a) == render_chat(b)


def test_render_chat_tools_key_order() -> None:
    t1 = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    t2 = [{"function": {"parameters": {"b": 2, "a": 1}, "name": "f"}, "type": "function"}]
    assert render_chat(BASE, t1) == render_chat(BASE, t2)


@pytest.mark.parametrize(
    ("b", "tools"),
    [
        pytest.param([{**BASE[0], "role": "developer"}, BASE[1]], None, id="role"),
        pytest.param([BASE[0], {**BASE[1], "name": "alice"}], None, id="name"),
        pytest.param(
            [BASE[0], {**BASE[1], "name": "bob"}],
            None,
            id="other-name",
        ),
        pytest.param(
            [*BASE, {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}],
            None,
            id="tool-calls-appended",
        ),
        pytest.param([BASE[0], {**BASE[1], "tool_call_id": "c1"}], None, id="tool-call-id"),
        pytest.param(BASE, [{"type": "function", "function": {"name": "f"}}], id="tools"),
        pytest.param([BASE[1], BASE[0]], None, id="message-order"),
        pytest.param([BASE[0]], None, id="fewer-messages"),
        pytest.param([BASE[0], {**BASE[1], "content": "What is 2+3?"}], None, id="content"),
    ],
)
def test_render_chat_differences_change_text(
    b: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    assert render_chat(b, tools) != render_chat(BASE)


def test_render_chat_distinguishes_tool_call_variants() -> None:
    def msg(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": None, "tool_calls": calls}]

    a = msg([{"id": "1", "function": {"name": "f", "arguments": "{}"}}])
    b = msg([{"id": "1", "function": {"name": "g", "arguments": "{}"}}])
    assert render_chat(a) != render_chat(b)
    assert render_chat([{"role": "tool", "tool_call_id": "c1", "content": "r"}]) != render_chat(
        [{"role": "tool", "tool_call_id": "c2", "content": "r"}]
    )


def test_render_chat_message_boundaries_matter() -> None:
    # One message "ab" is not two messages "a" + "b", nor a role change inside the text.
    one = [{"role": "user", "content": "ab"}]
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(one) != render_chat(two)


def test_render_chat_prefix_property() -> None:
    # Appending a turn extends the rendering: earlier turns form a prefix (what caching needs).
    longer = [*BASE, {"role": "assistant", "content": "4"}]
    assert render_chat(longer).startswith(render_chat(BASE))
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert render_chat(longer, tools).startswith(render_chat(BASE, tools))


def test_render_chat_does_not_mutate() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    original = copy.deepcopy(messages)
    render_chat(messages, [{"b": 1, "a": 2}])
    assert messages == original


def _translated(text: str, opts: NormalizeOptions) -> str:
    """The character rules alone, applied to every character as a plain table lookup."""
    return text.translate(_translation_table(opts.unicode_spaces, opts.invisible))


@pytest.mark.parametrize("opts", [
    DEFAULT,
    NormalizeOptions(invisible=False),
    NormalizeOptions(unicode_spaces=False),
])
def test_every_rewritten_character_is_found_in_text_of_any_width(opts: NormalizeOptions) -> None:
    rules = NormalizeOptions(enabled=True, unicode_spaces=opts.unicode_spaces,
                             invisible=opts.invisible, newlines=False,
                             trailing_whitespace=False, line_trailing_whitespace=False)
    table = _translation_table(opts.unicode_spaces, opts.invisible)
    # The same characters in texts CPython stores with 1, 2 and 4 bytes a character.
    for filler in ("caf\u00e9 ", "\u2019quoted\u2019 ", "emoji \U0001f600 "):
        for cp in table:
            text = filler * 3 + chr(cp) + filler
            assert normalize_text(text, rules) == _translated(text, rules), (filler, hex(cp))
    # Characters no rule touches, at every width, come back as they were.
    for text in ("caf\u00e9 \u00ff", "\u2019\u4e2d\u6587", "\U0001f600 \u2019", "\u200d\u200c"):
        assert normalize_text(text, rules) is text


@pytest.mark.parametrize("filler", ["\u2019quoted\u2019 ", "emoji \U0001f600 ", "\ud800 lone "])
def test_a_long_mostly_ascii_text_is_checked_by_its_non_ascii_characters(filler: str) -> None:
    # Long texts that are mostly ASCII are checked on their non-ASCII characters alone:
    # every rewritten character is found wherever it sits, whatever else the text holds.
    rules = NormalizeOptions(newlines=False, trailing_whitespace=False,
                             line_trailing_whitespace=False)
    table = _translation_table(rules.unicode_spaces, rules.invisible)
    ascii_part = "plain words " * 1000
    for cp in table:
        for text in (ascii_part + filler + chr(cp) + ascii_part,
                     chr(cp) + filler + ascii_part,
                     ascii_part + filler + "\u00e9" + chr(cp)):
            assert normalize_text(text, rules) == _translated(text, rules), (filler, hex(cp))
    untouched = ascii_part + filler + "\u4e2d\u00e9\u200d" + ascii_part
    assert normalize_text(untouched, rules) is untouched


def test_a_text_whose_samples_mislead_is_checked_whole() -> None:
    # ASCII where the samples are taken, CJK and one NBSP between them: dense text takes
    # the regex over the whole text, sparse the non-ASCII characters; both find the NBSP.
    cjk = "".join(chr(0x4E00 + i % 2000) for i in range(6000))
    for middle in (cjk + "\u00a0" + cjk, "x" * 3000 + "\u00a0" + cjk):
        text = "a" * 3000 + middle[: len(middle) // 2] + "b" * 2048 + middle[len(middle) // 2:]
        text += "c" * 3000
        assert normalize_text(text) == text.replace("\u00a0", " ")


def test_the_width_read_from_a_text_never_understates_it() -> None:
    for text, width in (("caf\u00e9", 1), ("\u2019", 2), ("\U0001f600", 4)):
        assert _char_width(text * 50) == width
        # A text whose UTF-8 copy CPython has cached (a class name does it) reads wider.
        named = (text * 50) + "x"
        type(named, (), {})
        assert _char_width(named) >= width
        assert normalize_text(named + "\u00a0\U000e0041y") == named + " y"


_LONG = {  # normal as they are: no line ends in a space, none at the end
    "ascii": "\n".join(["def f(x):", "    return x"] * 800),
    "latin-1": "\n".join(["caf\u00e9 cr\u00e8me"] * 1200),
    "bmp": "\n".join(["\u201cquoted\u201d \u2014 \u4e2d\u6587"] * 1200),
    "astral": "\n".join(["emoji \U0001f600 text"] * 1200),
}


@pytest.mark.parametrize("width", list(_LONG))
def test_a_long_normal_text_is_checked_once_per_scope(width: str) -> None:
    texts = NormalTexts(min_chars=1000)
    text = _LONG[width]
    tenant = texts.scope("tenant-a", "")
    assert normalize_text(text, DEFAULT, tenant) is text
    assert (len(texts), texts.hits) == (1, 0)
    assert normalize_text(text, DEFAULT, texts.scope("tenant-a", "")) is text
    assert texts.hits == 1
    # Another tenant, another cache salt or other rules: checked again, not recalled.
    for other, opts in ((texts.scope("tenant-b", ""), DEFAULT),
                        (texts.scope("tenant-a", "salt"), DEFAULT),
                        (tenant, NormalizeOptions(line_trailing_whitespace=False))):
        assert normalize_text(text, opts, other) is text
    assert (len(texts), texts.hits) == (4, 1)


def test_short_texts_and_texts_without_a_scope_are_not_remembered() -> None:
    texts = NormalTexts(min_chars=1000)
    scope = texts.scope("t", "")
    for _ in range(2):
        assert normalize_text("short and normal", DEFAULT, scope) == "short and normal"
        assert normalize_text("short, ragged \nx", DEFAULT, scope) == "short, ragged\nx"
        assert normalize_text(_LONG["ascii"], DEFAULT) is _LONG["ascii"]
    assert (len(texts), texts.hits) == (0, 0)


@pytest.mark.parametrize("width", list(_LONG))
def test_a_long_text_the_rules_rewrite_is_rewritten_once(width: str) -> None:
    # A context re-rendered with spaces at its lines' ends, and other rewrites.
    texts = NormalTexts(min_chars=1000)
    ragged = _LONG[width].replace("\n", " \t\n", 50).replace("\n", "\r\n", 3) + "\u00a0 "
    expected = normalize_text(ragged)
    assert expected != ragged
    first = normalize_text(ragged, DEFAULT, texts.scope("t", ""))
    again = normalize_text(ragged, DEFAULT, texts.scope("t", ""))
    assert first == again == expected
    assert (len(texts), texts.hits) == (1, 1)
    assert texts.held_bytes >= len(expected)
    # Another tenant rewrites it itself.
    assert normalize_text(ragged, DEFAULT, texts.scope("u", "")) == expected
    assert (len(texts), texts.hits) == (2, 1)


@pytest.mark.parametrize("width", list(_LONG))
def test_a_text_that_extends_a_rewritten_one_is_rewritten_past_it(width: str) -> None:
    for first, more in (
            (_LONG[width].replace("\n", "  \n", 40), "\nnormal from here"),
            (_LONG[width].replace("\n", "  \n", 40) + "  ", "\nthe last line ended in spaces"),
            (_LONG[width] + " \r\nragged last lines \n\u00a0", " end\n  \nmore \n"),
            ("x" * 1200 + "\u2028" + _LONG[width] + "\u3000", "\u2029 tail"),
            ("one line\u00a0" * 150, " and more\u00a0 \nnext")):
        texts = NormalTexts(min_chars=1000)
        scope = texts.scope("t", "")
        assert normalize_text(first, DEFAULT, scope) == normalize_text(first)
        turns = [first + more, first + more + more, first + more + more + "\n" + first]
        for turn in turns:
            assert normalize_text(turn, DEFAULT, scope) == normalize_text(turn), (first, more)
        assert texts.prefix_hits == 3


def test_rewritten_texts_are_held_within_their_budget() -> None:
    texts = NormalTexts(min_chars=1000, rewritten_bytes=10_000)
    scope = texts.scope("t", "")
    a, b = ("a  \n" * 800, "b  \n" * 800)  # 3,200 characters, 1,600 rewritten: 4,800 held
    for text in (a, b, a):
        normalize_text(text, DEFAULT, scope)
    assert len(texts) == 2
    assert texts.held_bytes == 9600  # b, then a again
    normalize_text("c  \n" * 1500, DEFAULT, scope)  # 6,000 + 3,000: only it fits
    assert len(texts) == 1
    assert texts.held_bytes == 9000
    longer = a + "more  \n"  # a's rewriting is gone: the rules run on the whole text
    assert normalize_text(longer, DEFAULT, scope) == "a\n" * 800 + "more"
    assert texts.prefix_hits == 0
    assert texts.held_bytes == 3207 + 1605  # the longer a; c made room
    normalize_text("d  \n" * 3000, DEFAULT, scope)  # over the budget alone: not held
    assert texts.held_bytes == 3207 + 1605


def test_a_rewriting_is_used_only_for_the_text_it_was_made_of() -> None:
    # Keys that collide (forced here) never hand a request another text's rewriting.
    texts = NormalTexts(min_chars=1000)
    scope = texts.scope("t", "")
    mine, other = "mine  \n" * 200, "other  \n" * 200
    look = scope.look(mine, DEFAULT)
    texts.add_rewritten(look.key, look.opening, look.size, other, "LEAKED", 0)
    assert normalize_text(mine + "more", DEFAULT, scope) == "mine\n" * 200 + "more"
    assert texts.prefix_hits == 0
    assert normalize_text(mine, DEFAULT, scope) == "mine\n" * 199 + "mine"
    assert texts.hits == 0


def test_normal_texts_keep_the_most_recently_seen() -> None:
    texts = NormalTexts(capacity=2, min_chars=10)
    scope = texts.scope("t", "")
    a, b, c = ("a" * 20, "b" * 20, "c" * 20)
    for text in (a, b, a, c):  # a seen again before c arrives: b is the oldest
        normalize_text(text, DEFAULT, scope)
    assert len(texts) == 2
    hits = texts.hits
    normalize_text(a, DEFAULT, scope)
    normalize_text(c, DEFAULT, scope)
    assert texts.hits == hits + 2
    normalize_text(b, DEFAULT, scope)
    assert texts.hits == hits + 2


def test_parsing_a_chat_again_recalls_its_long_contents() -> None:
    texts = NormalTexts(min_chars=1000)
    body = {"model": "m", "messages": [{"role": "system", "content": _LONG["bmp"]},
                                       {"role": "user", "content": "hi"}]}
    first = parse_chat(body, DEFAULT, texts.scope("t", ""))
    again = parse_chat(body, DEFAULT, texts.scope("t", ""))
    assert texts.hits == 1
    assert again.unchanged
    assert again.fingerprint_text == first.fingerprint_text


def test_prepare_builds_the_rules_before_any_text_needs_them() -> None:
    _rewrites.cache_clear()
    prepare(NormalizeOptions(enabled=False))
    assert _rewrites.cache_info().currsize == 0
    prepare(DEFAULT)
    assert _rewrites.cache_info().currsize == 1
    normalize_text("caf\u00e9\u00a0")
    assert _rewrites.cache_info().hits >= 1


def test_a_long_text_ending_in_whitespace_is_remembered_and_trimmed() -> None:
    texts = NormalTexts(min_chars=1000)
    text = _LONG["bmp"] + "\n\n"
    for _ in range(2):
        assert normalize_text(text, DEFAULT, texts.scope("t", "")) == _LONG["bmp"]
    assert (len(texts), texts.hits) == (1, 1)


@pytest.mark.parametrize("width", list(_LONG))
def test_a_text_that_extends_a_remembered_one_is_checked_past_it(width: str) -> None:
    # A completions agent's next turn: the last prompt and more. The rules start from the
    # remembered text's last line, whose end may now be a line's end.
    for known_end, more in (("", "\nnext line"),
                            ("  ", "\nthe last line ended in spaces"),
                            ("\n\n", "a new paragraph \nwith a ragged line"),
                            (" tail", "\u00a0with NBSP\u200b and\r\nCRLF"),
                            ("", "\U0001f600 wider now")):
        texts = NormalTexts(min_chars=1000)
        scope = texts.scope("t", "")
        first = _LONG[width] + known_end
        assert normalize_text(first, DEFAULT, scope) == normalize_text(first)
        assert len(texts) == 1
        longer = first + more
        assert normalize_text(longer, DEFAULT, scope) == normalize_text(longer), (known_end, more)
        wider = _char_width(longer) > _char_width(first)  # stored otherwise: compared whole
        assert texts.prefix_hits == (0 if wider else 1), (known_end, more)


def test_a_text_that_parts_from_a_remembered_one_is_checked_whole() -> None:
    texts = NormalTexts(min_chars=1000)
    scope = texts.scope("t", "")
    first = _LONG["ascii"]
    normalize_text(first, DEFAULT, scope)
    # The same length and more, but one character changed well inside the remembered text.
    parted = first[:500] + "\u00a0" + first[501:] + "\nmore"
    assert normalize_text(parted, DEFAULT, scope) == parted.replace("\u00a0", " ")
    # Another tenant, or other rules, never begin from this tenant's texts.
    assert normalize_text(first + "  \nmore", DEFAULT, texts.scope("u", "")) == first + "\nmore"
    other = NormalizeOptions(line_trailing_whitespace=False)
    assert normalize_text(first + "  \nmore", other, scope) == first + "  \nmore"
    assert texts.prefix_hits == 0
    # Each extension is remembered in turn: the next one begins from the longest.
    second = first + "\nsecond"
    normalize_text(second, DEFAULT, scope)
    third = second + "  \nthird"
    assert normalize_text(third, DEFAULT, scope) == second + "\nthird"
    assert texts.prefix_hits == 2


def test_the_line_rule_leaves_the_last_line_to_the_end_of_text_rule() -> None:
    # What the line rule makes of a line never depends on other lines: the last line ends
    # where the text does, which is trailing_whitespace's.
    keep_end = NormalizeOptions(trailing_whitespace=False)
    assert normalize_text("a  \nb  ", keep_end) == "a\nb  "
    assert normalize_text("a\nb  ", keep_end) == "a\nb  "
    assert normalize_text("a  \nb  ") == "a\nb"
    # Text parts render as one text: spaces before the next part's text are not a line's end.
    parts = normalize_content([{"type": "text", "text": "x  \ny  "},
                               {"type": "text", "text": "z"}], DEFAULT)
    assert "".join(p["text"] for p in parts) == "x\ny  z"


def test_the_responses_apis_text_parts_are_normalized_and_odd_parts_left_alone() -> None:
    parts = normalize_content([{"type": "input_text", "text": "a\u00a0b\u200b "},
                               {"type": [], "text": "c\u00a0"},  # not a part type: as it came
                               {"type": "output_text", "text": "d  "}], DEFAULT)
    assert [p["text"] for p in parts] == ["a b ", "c\u00a0", "d"]
