"""Prompt normalization and the canonical rendering of chat requests.

Two prompts that differ only in characters a reader cannot see should share a prefix cache
entry. Clients produce such differences all the time: NBSP from a rich-text editor, a zero-width
space pasted from a web page, CRLF from Windows, a trailing newline added by a template. Each one
silently changes the token sequence and costs a full prefill on the worker.

The gateway therefore rewrites every prompt with :func:`normalize_text` *before* it is
fingerprinted, and forwards the rewritten prompt to the worker: what is fingerprinted is what the
worker receives, so the routing key and the worker's cache key never disagree.

Rules (each can be switched off in :class:`NormalizeOptions`):

* ``unicode_spaces``: every space separator (Unicode category Zs: NBSP, thin space, ideographic
  space, ...) becomes U+0020; line and paragraph separators (U+2028/U+2029) become ``\\n``.
* ``invisible``: invisible format characters (category Cf: zero-width space, word joiner, BOM,
  soft hyphen, bidi controls, tag characters) are removed, except ZWJ and ZWNJ (U+200D, U+200C),
  which change how emoji sequences and Indic/Persian scripts render.
* ``newlines``: CRLF and lone CR become LF.
* ``trailing_whitespace``: trailing whitespace is trimmed from each prompt / message content.
* ``line_trailing_whitespace``: spaces and tabs at the end of every line are trimmed too.
  Agent frameworks and editors re-emit the same context with trailing spaces on inner lines
  (a re-rendered file, a reformatted tool result); without this each such re-render is a new
  prefix from its first changed line on. Off for clients whose prompts mean something by
  trailing spaces (``--no-trim-line-whitespace``).

Chat requests are fingerprinted over :func:`render_chat`, one canonical rendering of the tools
and messages (role, name, content parts, tool calls), so that two requests with the same
conversation produce the same text whatever JSON key order or content-part split they used.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.contracts.chat import canonical_json
from gateway.normal_texts import TextScope, char_width

_KEEP_FORMAT_CHARS = frozenset({0x200C, 0x200D})
# A line that ends in a space or a tab. The pattern starts with its one literal character, so
# the regex engine skips from newline to newline and looks back only there: one pass over the
# text for both characters, about 0.7 ns a character. The substring tests " \n" and "\t\n"
# cost two passes of 1.4 and 0.6 ns a character on text full of spaces (code, prose), which
# on a 640,000-character prompt was over a millisecond.
_BLANK_LINE_END = re.compile(r"\n(?<=[ \t]\n)")


@dataclass(frozen=True, slots=True)
class NormalizeOptions:
    enabled: bool = True
    unicode_spaces: bool = True
    invisible: bool = True
    newlines: bool = True
    trailing_whitespace: bool = True
    line_trailing_whitespace: bool = True


@functools.cache
def _translation_table(unicode_spaces: bool, invisible: bool) -> dict[int, str | None]:
    """Code point -> replacement, built once per option set (about 0.2 s, then cached)."""
    table: dict[int, str | None] = {}
    for cp in range(sys.maxunicode + 1):
        if cp < 0x80:
            continue
        cat = unicodedata.category(chr(cp))
        if unicode_spaces and cat == "Zs":
            table[cp] = " "
        elif unicode_spaces and cat in ("Zl", "Zp"):
            table[cp] = "\n"
        elif invisible and cat == "Cf" and cp not in _KEEP_FORMAT_CHARS:
            table[cp] = None
    return table


def _class_of(code_points: list[int]) -> re.Pattern[str] | None:
    """A regex class of ``code_points`` (None for none), written as runs."""
    if not code_points:
        return None
    runs: list[tuple[int, int]] = []
    for cp in code_points:
        if runs and runs[-1][1] == cp - 1:
            runs[-1] = (runs[-1][0], cp)
        else:
            runs.append((cp, cp))
    return re.compile("[" + "".join(
        re.escape(chr(a)) + ("-" + re.escape(chr(b)) if b > a else "") for a, b in runs) + "]")


# A long text that is not ASCII is mostly ASCII when it is prose or code with a quote, a
# dash or an emoji here and there. The rules look at its non-ASCII characters only: the text
# encoded to UTF-8 (about 1.4 ns a character) less its ASCII bytes (bytes.translate, about
# 0.8 ns a byte) is the UTF-8 of those characters in order, since no byte of a multi-byte
# sequence is ASCII. Tested on the whole text the regex class costs 5 ns a character. Text
# that is mostly not ASCII (CJK) would pay both passes for nothing, so a sample of the text
# decides; either way the answer is the same, only its cost differs.
_SPARSE_MIN_CHARS = 8192
_SAMPLE_CHARS = 1024
_ASCII_BYTES = bytes(range(0x80))


def _mostly_ascii(text: str) -> bool:
    """Whether samples from the start, the middle and the end of ``text`` are at least nine
    tenths ASCII."""
    middle = len(text) // 2
    sample = text[:_SAMPLE_CHARS] + text[middle:middle + _SAMPLE_CHARS] + text[-_SAMPLE_CHARS:]
    return len(sample.encode("ascii", "ignore")) * 10 >= len(sample) * 9


def _non_ascii(text: str) -> str:
    """The non-ASCII characters of ``text``, in order (lone surrogates included)."""
    data = text.encode("utf-8", "surrogatepass").translate(None, _ASCII_BYTES)
    return data.decode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class _Rewrites:
    """The characters one option set rewrites, and a fast test for whether a text holds any.

    ``str.translate`` looks every character up in the table, about 30 ns a character on any
    non-ASCII text (20 ms for a 640,000-character prompt with one curly quote), though most
    texts hold none of these characters. The test costs a fraction of that: in a text of one
    byte a character only two of them can occur, each found at memory speed; in the Basic
    Multilingual Plane the regex engine tests its class by a bitmap, about 5 ns a
    character; the few beyond it (tag characters, some format controls) are looked for only
    in texts that can hold them, by the first three bytes of their UTF-8 forms (a class of
    them costs the regex engine 15 ns a character; a prefix that also begins a character no
    rule touches only sends the text to the table).
    """

    table: dict[int, str | None]
    latin1: tuple[str, ...]
    bmp: re.Pattern[str] | None
    astral: tuple[bytes, ...]

    def found_in(self, text: str) -> bool:
        """Whether non-ASCII ``text`` holds a character this option set rewrites."""
        width = char_width(text)
        if width == 1:
            return any(c in text for c in self.latin1)
        if len(text) >= _SPARSE_MIN_CHARS and _mostly_ascii(text):
            text = _non_ascii(text)
            width = char_width(text)
            if width == 1:
                return any(c in text for c in self.latin1)
        if self.bmp is not None and self.bmp.search(text) is not None:
            return True
        if width < 4 or not self.astral:
            return False
        data = text.encode("utf-8", "surrogatepass")
        return any(prefix in data for prefix in self.astral)


def prepare(opts: NormalizeOptions) -> None:
    """Build the character rules' tables now (about 0.15 s, once per process), so that the
    first request with text that is not ASCII does not stall the event loop for it."""
    if opts.enabled and (opts.unicode_spaces or opts.invisible):
        _rewrites(opts.unicode_spaces, opts.invisible)


@functools.cache
def _rewrites(unicode_spaces: bool, invisible: bool) -> _Rewrites:
    table = _translation_table(unicode_spaces, invisible)
    points = sorted(table)
    return _Rewrites(
        table=table,
        latin1=tuple(chr(cp) for cp in points if cp <= 0xFF),
        bmp=_class_of([cp for cp in points if cp <= 0xFFFF]),
        astral=tuple(sorted({chr(cp).encode()[:3] for cp in points if cp > 0xFFFF})),
    )


def normalize_text(
    text: str, opts: NormalizeOptions = NormalizeOptions(), seen: TextScope | None = None
) -> str:
    """Apply the normalization rules to one prompt or message content; ``seen`` remembers
    long texts that the rules leave as they are, but for whitespace at their very end (a
    content that ends in a newline is common, and trimming it costs nothing)."""
    if not opts.enabled:
        return text
    if seen is None or len(text) < seen.texts.min_chars:
        out = _normalized(text, opts)
    else:
        look = seen.look(text, opts)
        if look.known:
            out = text if look.output is None else look.output
        else:
            out = _normalized_past(text, opts, look.prefix, look.head)
            if out is text:  # every rule returns the text itself when it changes nothing
                look.remember(seen.texts, text)
            else:
                head = len(out) - _last_line_normalized(text, opts) if "\n" in text else 0
                look.remember(seen.texts, text, out, head)
    return out.rstrip() if opts.trailing_whitespace else out


@dataclass(frozen=True, slots=True)
class NormalPrefix:
    """What the rules made of a text, for a later text that begins with it (an agent's next
    turn): its length in characters, and ``head``, what they made of its lines before its
    last one (None: they left the whole text as it was)."""

    chars: int
    head: str | None


def normalize_after(text: str, opts: NormalizeOptions,
                    known: NormalPrefix) -> tuple[str, NormalPrefix]:
    """:func:`normalize_text` of ``text``, whose first ``known.chars`` characters are the text
    ``known`` was made of (the caller's word: a long prompt's earlier turn, found by the bytes
    that carried it), and what a later text that begins with this one needs. The rules run
    from that text's last line on (:func:`_normalized_past`); no memo is read or written."""
    if not opts.enabled:
        return text, NormalPrefix(len(text), None)
    out = _normalized_past(text, opts, known.chars, known.head)
    if out is text:
        after = NormalPrefix(len(text), None)
    else:
        last = _last_line_normalized(text, opts) if "\n" in text else len(out)
        after = NormalPrefix(len(text), out[:len(out) - last])
    return (out.rstrip() if opts.trailing_whitespace else out), after


def _normalized_past(text: str, opts: NormalizeOptions, known: int, head: str | None) -> str:
    """:func:`_normalized` of ``text`` whose first ``known`` characters are a text the rules
    have seen: ``head`` is what they made of that text's lines before its last one (None:
    they left the text as it was). Every rule is local to a character or a line, and only
    the last line of that text can change with what follows it (its end was not a line's end
    there), so the rules start from that line."""
    if known == 0:
        return _normalized(text, opts)
    start = text.rfind("\n", 0, known) + 1
    rest = text[start:]
    out = _normalized(rest, opts)
    if head is not None:
        return head + out
    return text if out is rest else text[:start] + out


def _last_line_normalized(text: str, opts: NormalizeOptions) -> int:
    """The length of what the rules make of ``text``'s last line (after its last newline):
    what they make of the whole text ends with it, every rule being local to a line. (The
    caller passes a text with a newline: of one line, all of it is the last.)"""
    return len(_normalized(text[text.rfind("\n") + 1:], opts))


def _normalized(text: str, opts: NormalizeOptions) -> str:
    """Every rule but the trim at the end of the text."""
    if (opts.unicode_spaces or opts.invisible) and not text.isascii():
        rewrites = _rewrites(opts.unicode_spaces, opts.invisible)
        if rewrites.found_in(text):
            text = text.translate(rewrites.table)
    if opts.newlines and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    # "\n" first: a text of one line (no newline) is told at memory speed.
    if (opts.line_trailing_whitespace and "\n" in text
            and _BLANK_LINE_END.search(text) is not None):
        # One pass over the lines: linear in the text whatever it holds (a regex over runs of
        # spaces backtracks quadratically on a long run that does not end a line). The last
        # line does not end in a newline: its end is the text's (``trailing_whitespace``), so
        # what the rule makes of a line never depends on other lines.
        lines = text.split("\n")
        last = lines.pop()
        lines = [line.rstrip(" \t") for line in lines]
        lines.append(last)
        text = "\n".join(lines)
    return text


def normalize_content(
    content: Any, opts: NormalizeOptions, seen: TextScope | None = None
) -> Any:
    """Normalize a chat message ``content``: a string or a list of content parts."""
    if isinstance(content, str):
        return normalize_text(content, opts, seen)
    if isinstance(content, list):
        # Parts render as one text, so only the end of the whole content is trimmed.
        inner = dataclasses.replace(opts, trailing_whitespace=False)
        parts: list[Any] = []
        for part in content:
            if _is_text_part(part):
                parts.append({**part, "text": normalize_text(part["text"], inner, seen)})
            else:
                parts.append(part)
        if opts.enabled and opts.line_trailing_whitespace:
            # A line may end where one text part ends and the next begins with a newline.
            for before, after in itertools.pairwise(parts):
                if _is_text_part(before) and _is_text_part(after) and after["text"][:1] == "\n":
                    before["text"] = before["text"].rstrip(" \t")
        if opts.enabled and opts.trailing_whitespace and parts and _is_text_part(parts[-1]):
            parts[-1]["text"] = parts[-1]["text"].rstrip()
        return parts
    return content


# Content parts whose ``text`` is text: chat's, and the Responses API's input and output text.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _is_text_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return isinstance(kind, str) and kind in _TEXT_PARTS and isinstance(part.get("text"), str)


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], opts: NormalizeOptions, seen: TextScope | None = None
) -> list[dict[str, Any]]:
    """A copy of ``messages`` with every text content normalized (other fields untouched)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        copy = dict(message)
        if "content" in copy:
            copy["content"] = normalize_content(copy["content"], opts, seen)
        out.append(copy)
    return out


# Separators that cannot be confused with message text: ASCII record / unit separators.
_RS = "\x1e"
_US = "\x1f"


def _render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            else:
                pieces.append(canonical_json(part))
        # Adjacent text parts render as one text: ["ab"] and ["a", "b"] give the same prompt.
        return "".join(pieces)
    return canonical_json(content)


def render_tools(tools: Sequence[Any] | None) -> str:
    """The tools' part of :func:`render_chat` (empty without tools)."""
    return f"{_RS}tools{_US}{canonical_json(list(tools))}" if tools else ""


def render_messages(messages: Iterable[Mapping[str, Any]], head: str = "") -> str:
    """``head`` followed by the messages' part of :func:`render_chat`: the rendering of a
    conversation is the rendering of its first messages followed by that of the rest."""
    out: list[str] = [head]
    for message in messages:
        role = str(message.get("role", ""))
        name = message.get("name")
        head = f"{role}:{name}" if isinstance(name, str) and name else role
        body = _render_content(message.get("content"))
        if message.get("tool_calls"):
            body += _US + canonical_json(message["tool_calls"])
        if message.get("tool_call_id"):
            body += _US + str(message["tool_call_id"])
        out += (_RS, head, _US, body)  # joined once: a long prompt is copied one time
    return "".join(out)


def render_chat(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
) -> str:
    """The canonical text of a chat request, the input to the prefix fingerprint.

    Tools come first (they sit at the top of every chat template), then each message as
    ``RS role[:name] US content`` with tool calls and tool-call ids appended in canonical JSON.
    """
    return render_messages(messages, render_tools(tools))
