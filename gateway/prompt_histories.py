"""Long completions prompts already decoded, found again by the bytes that carried them.

An agent that speaks ``/v1/completions`` sends its whole context as one ``prompt`` string on
every turn: the next body is this turn's, byte for byte, up to where the prompt text grows.
At 200k tokens the string is most of a megabyte, and decoding it again is most of what such a
request costs the gateway past its bytes on the wire. :class:`PromptHistories` remembers, for
a long body whose prompt is a string, where in its bytes that string closes (the *end*), a
keyed hash of the bytes before it, the body's keys before ``prompt`` and the prompt as
decoded. A later body that starts with the same bytes is decoded from the end on only:

* **Where the end is.** The closing quote of the prompt: first where the body's keys after
  the prompt, written as the common encoders write them (compact, or Python's spaced
  default), end the body; else the first ``"`` that no odd run of backslashes escapes,
  searched from where the text's length puts the earliest possible close (a byte at least
  per character), looking at a few hundred quotes at most, so that a prompt of escaped
  quotes costs no scan per quote (such a body is simply not remembered). A first body's end
  is checked when a later body is found by it, by decoding the bytes before it closed there
  with a mark added to the string it cuts (``...`` -> ``...~"}``): the result must be the
  body's keys before ``prompt`` and the prompt with the mark (without the mark, a key
  repeated after the prompt with the value it had before would pass for it). A joined
  body's end is checked when it is remembered, by decoding only the bytes between its
  entry's end and its own: they must be what its prompt adds.
* **Joining.** The bytes before the end are the earlier body's, so a JSON parser reaches the
  end in the same state: inside the top-level object after the same keys, inside the prompt
  string after the same characters (a string can be cut wherever a character ends). What
  follows is decoded as ``{"\\u0000p":"`` + the rest of the body: its seam string is what the
  prompt adds, its other keys the body's keys after ``prompt``. A body is joined only when
  none of those repeats a key before the prompt or the prompt itself (the decoder lets the
  last of repeated keys win) or is ``cache_salt`` (a body with a salt after its prompt is not
  remembered either, so an entry is never used across salts), and the rest writes no NUL
  character (``\\u0000``: the seam's key can be spelled only with it).
* **Normalization.** An entry also keeps what the rules made of its prompt
  (:class:`gateway.normalize.NormalPrefix`: nothing, or its lines but the last as rewritten),
  where the parse knew it: a first prompt the rules left as it was, and every prompt joined
  to such an entry. A joined prompt is then normalized from the earlier prompt's last line on
  (:func:`gateway.normalize.normalize_after`), without hashing the whole text to find it in
  :mod:`gateway.normal_texts`.
* **Checks.** The rest is checked for depth as :func:`gateway.openai_schema.decode_json_object`
  checks a whole body. A rest that does not decode or check is decoded again as a whole body,
  which raises the client's error as it would have.

The decoded body is the one :func:`gateway.openai_schema.decode_json_object` returns for the
same bytes, and the normalized prompt the one :func:`gateway.normalize.normalize_text` makes
(the tests compare them on every shape of body they build). Entries are scoped by tenant
and normalization options and hold prompt text in this process's memory only, never in a log,
a response or the store, bounded by the bytes of the bodies they stand for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.body_prefixes import ANCHOR_BYTES, BodyMemo, Prefix, marks
from gateway.normalize import NormalPrefix
from gateway.openai_schema import decode_json_object, too_deep

_SEAM_KEY = "\x00p"
_SEAM = b'{"\\u0000p":"'
_NUL_ESCAPE = b"\\u0000"
_PROMPT_KEY = b'"prompt"'
_BEFORE_KEY = frozenset(b"{, \t\r\n")
_WHITESPACE = b" \t\r\n"
_QUOTE = 0x22
# Added to the string cut at an end being checked (:func:`_closes_prompt`).
_MARK = b"~"
_MARK_TEXT = "~"
# Quotes the search for a prompt's end looks at: this many, and one more per so many bytes.
_SCAN_QUOTES = 256
_SCAN_BYTES_PER_QUOTE = 4096


@dataclass(slots=True, eq=False)
class _Entry(Prefix):
    # ``end``: where the body's prompt string closes
    head: dict[str, Any]  # the body's keys before "prompt"
    text: str  # the prompt, as decoded
    normal: NormalPrefix | None  # what normalization made of it, where the parse knows


class PromptHistories(BodyMemo[_Entry]):
    """Recent long completions prompts by tenant, for :meth:`decode` to skip the part already
    seen."""

    def decode(self, raw: bytes, seed: int) -> tuple[dict[str, Any], KnownPrompt | None]:
        """The body of ``raw`` as :func:`decode_json_object` decodes it (the same object, the
        same errors), and the earlier body of scope ``seed`` whose prompt it extends (None:
        none found)."""
        found = self._found(raw, seed, _closes_prompt, _joined)
        if found is not None:
            return found[0], KnownPrompt(found[1])
        return decode_json_object(raw), None

    def remember(self, raw: bytes, seed: int, body: dict[str, Any],
                 joined: KnownPrompt | None = None, normal: NormalPrefix | None = None) -> None:
        """Keep ``body``'s prompt for a later body of scope ``seed`` that starts with the same
        bytes up to where the prompt string closes. ``joined``: what :meth:`decode` found;
        ``normal``: what normalization made of the prompt, if known."""
        text = body.get("prompt")
        if len(raw) < self.min_bytes or not isinstance(text, str):
            return
        base = joined.entry if joined is not None else None
        head, after = _around_prompt(body)
        if base is not None:
            head = base.head
            # The prompt goes on from the base's end, a byte at least for each new character;
            # what it adds is checked to be the bytes up to the end (a decoding of them only).
            end = _prompt_end(raw, after, base.end + len(text) - len(base.text))
            if end < base.end or not _encodes_string(raw[base.end:end], text[len(base.text):]):
                return
        else:
            if "cache_salt" in after:
                return  # a salt after the prompt: no later body would be joined
            opening = _string_after_key(raw)
            end = _prompt_end(raw, after, opening + len(text)) if opening > 0 else -1
        if end < ANCHOR_BYTES:
            return
        guard, digest, anchor = marks(raw, end, seed)
        self._store.add(_Entry(
            end=end, guard=guard, digest=digest, anchor=anchor,
            # A first body is checked when a next turn comes; a joined one was, by its join.
            checked=base is not None, head=head, text=text, normal=normal,
        ), replaces=base)


class KnownPrompt:
    """What :meth:`PromptHistories.decode` found for a body: the earlier prompt it extends."""

    __slots__ = ("entry",)

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry

    @property
    def normal(self) -> NormalPrefix | None:
        """What normalization made of the earlier prompt (None: not known)."""
        return self.entry.normal


def _string_after_key(raw: bytes) -> int:
    """Where the value of the first ``"prompt"`` key in ``raw`` begins, inside its string
    (-1: not a string there). A wrong guess is caught by :func:`_closes_prompt`."""
    key = raw.find(_PROMPT_KEY)
    if key < 1 or raw[key - 1] not in _BEFORE_KEY:
        return -1
    i = key + len(_PROMPT_KEY)
    size = len(raw)
    while i < size and raw[i] in _WHITESPACE:
        i += 1
    if i >= size or raw[i] != ord(":"):
        return -1
    i += 1
    while i < size and raw[i] in _WHITESPACE:
        i += 1
    return i + 1 if i < size and raw[i] == _QUOTE else -1


def _around_prompt(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``body``'s keys before ``prompt``, and after it."""
    head: dict[str, Any] = {}
    after: dict[str, Any] = {}
    into = head
    for key, value in body.items():
        if key == "prompt":
            into = after
        else:
            into[key] = value
    return head, after


def _prompt_end(raw: bytes, after: dict[str, Any], start: int) -> int:
    """Where the prompt string closes in ``raw`` (-1: not found), at or after ``start``.
    First where the keys after the prompt, written as the common encoders write them, end
    the body; else the first ``"`` from ``start`` on that no backslash escapes, among at
    most a few hundred (a client's prompt of escaped quotes must not cost a scan per quote).
    A wrong guess is caught where the end is used (:func:`_closes_prompt`, or the caller's
    decoding of what a joined prompt adds)."""
    size = len(raw.rstrip(_WHITESPACE))
    for tail in _tails(after):
        end = size - len(tail) - 1
        if end >= start and raw[end] == _QUOTE and raw.endswith(tail, 0, size):
            return end
    return _closing_quote(raw, start, _SCAN_QUOTES + len(raw) // _SCAN_BYTES_PER_QUOTE)


def _tails(after: dict[str, Any]) -> tuple[bytes, ...]:
    """The bytes after a prompt's closing quote, for the keys ``after`` it, compact (orjson,
    JavaScript, most clients) and spaced (Python's ``json`` by default)."""
    if not after:
        return (b"}",)
    try:
        compact = orjson.dumps(after)
        spaced = json.dumps(after).encode()
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return ()
    return b"," + compact[1:], b", " + spaced[1:]


def _closing_quote(raw: bytes, start: int, quotes: int) -> int:
    """The first ``"`` at or after ``start`` that no backslash escapes (a run of backslashes
    before it is even: escapes never end in a backslash but for the pair ``\\\\``), looking
    at ``quotes`` of them at most (-1: none found)."""
    pos = start
    for _ in range(quotes):
        quote = raw.find(b'"', pos)
        if quote < 0:
            return -1
        if _backslashes_before(raw, quote) % 2 == 0:
            return quote
        pos = quote + 1
    return -1


def _backslashes_before(raw: bytes, at: int) -> int:
    """The length of the run of backslashes that ends just before ``at`` (looked at 64 bytes
    at a time, in C)."""
    run = 0
    while at > 0:
        window = raw[max(0, at - 64):at]
        kept = len(window.rstrip(b"\\"))
        run += len(window) - kept
        if kept:
            return run
        at -= len(window)
    return run


def _encodes_string(content: bytes, text: str) -> bool:
    """Whether ``content`` is the inside of a JSON string that decodes to ``text``."""
    try:
        return bool(orjson.loads(b'"' + content + b'"') == text)
    except orjson.JSONDecodeError:
        return False


def _closes_prompt(raw: bytes, entry: _Entry) -> bool:
    """Whether ``raw`` up to ``entry.end`` (the bytes of ``entry``'s body up to there) is that
    body up to its prompt's closing quote: decoded closed there with a mark added to the
    string cut there, it is the body's keys before ``prompt`` and the prompt with the mark.
    The mark makes sure the string cut there is the prompt: without it, a key repeated after
    the prompt with the value it already had (``..."prompt":"...","model":"m"}``, whose end
    the keys after the prompt put at the close of the repeated value) decodes closed there
    to the same object."""
    try:
        closed = orjson.loads(raw[:entry.end] + _MARK + b'"}')
    except orjson.JSONDecodeError:
        return False
    return bool(closed == {**entry.head, "prompt": entry.text + _MARK_TEXT})


def _joined(raw: bytes, entry: _Entry) -> dict[str, Any] | None:
    """The body of ``raw``, whose bytes before ``entry.end`` are those of ``entry``'s body
    (None where the rest does not decode, or the join could differ from decoding it whole)."""
    tail = raw[entry.end:]
    if _NUL_ESCAPE in tail:
        return None
    document = _SEAM + tail
    try:
        value = orjson.loads(document)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    more = value.pop(_SEAM_KEY, None)
    head = entry.head
    if (not isinstance(more, str) or "prompt" in value or "cache_salt" in value
            or any(k in head for k in value)):
        return None
    if too_deep(document, value):
        return None
    return {**head, "prompt": entry.text + more, **value}
