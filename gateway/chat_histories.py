"""Long chats already decoded and checked, found again by the bytes that carried them.

A chat client or an agent sends its whole conversation on every turn: the body of the next
turn is this turn's, byte for byte, up to where the new messages begin. An agent's body holds
thousands of messages (a megabyte at 200k tokens), and decoding, checking, normalizing and
rendering each of them again is most of what such a request costs the gateway.
:class:`ChatHistories` remembers, for a long chat, where in its body the last message began
(the *end* of its history), a keyed hash of the bytes before it, and the messages before it,
as decoded and as :func:`gateway.openai_schema.parse_chat` left them. A later body that starts
with the same bytes is decoded from the end on only:

* **Where the end is.** It is where the last message's first key begins, the last such bytes
  in the body. That the bytes before it are the body up to that message, inside
  ``messages``, is checked by decoding them closed there (``...,`` -> ``...]}``): the result
  must be the body's keys before ``messages`` and its messages but the last. A chat's first
  body is checked so when a later body is found by it (a long chat sent once costs no second
  decoding); a body that was itself joined is checked when it is remembered, and only in the
  bytes after the history it was joined to.
* **Joining.** The bytes before the end are the earlier body's, so a JSON parser reaches the
  end in the same state: inside the top-level object with the same keys and values, inside
  ``messages``, after the same messages and a comma. What follows is decoded as
  ``{"\\u0000m":[0,`` + the rest of the body, which a parser reads exactly as it reads that
  rest in place (an object and an array open at the seam, a value due after a comma): its
  array but the 0 is the new messages, its other keys the body's keys after ``messages``. A
  body is joined only when none of those repeats a key before the messages (the decoder lets
  the last of repeated keys win), the rest writes no NUL character (``\\u0000``: the seam's
  key can be spelled only with it, in more ways than one), and none of its keys is
  ``cache_salt`` (so an entry is never used across salts).
* **Checks.** The rest is checked for depth as :func:`gateway.openai_schema.decode_json_object`
  checks a whole body (the history passed that check when it came first). A rest that does
  not decode or check is decoded again as a whole body, which raises the client's error as
  it would have.

The decoded body is the one :func:`gateway.openai_schema.decode_json_object` returns for the
same bytes (the tests compare them on every shape of body they build). Entries are scoped by
tenant and normalization options: one tenant's chats never make another's faster. They hold
decoded messages (prompt text; and where normalization changed them, their JSON as the worker
gets it) in this process's memory only, never in a log, a response or the store, bounded by
the bytes of the bodies they stand for; the one used least recently goes
first, and a chat's next turn replaces the entry it was joined to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.body_prefixes import ANCHOR_BYTES, BodyMemo, Prefix, marks
from gateway.openai_schema import KnownHistory, decode_json_object, too_deep

# The seam: the rest of a body decodes as the array of this key, which no client key is
# allowed to be spelled like (a NUL in a JSON string can only be written as an escape, and a
# rest with that escape anywhere is decoded as a whole body instead).
_SEAM_KEY = "\x00m"
_SEAM = b'{"\\u0000m":[0,'
_NUL_ESCAPE = b"\\u0000"


@dataclass(slots=True, eq=False)
class _Entry(Prefix):
    # ``end``: where the body's last message began
    head: dict[str, Any]  # the body's keys before "messages"
    messages: tuple[Any, ...]  # the messages before ``end``, as decoded
    known: KnownHistory


# What must come before a Responses request's input items for its history to be known: its
# salt (the namespace). Its instructions may follow them: the parse checks them against the
# history's first message (gateway.openai_schema.parse_responses).
RESPONSES_BEFORE_INPUT = frozenset({"cache_salt"})


class ChatHistories(BodyMemo[_Entry]):
    """Recent long chats by tenant, for :meth:`decode` to skip the part already seen.

    ``key`` names the array of messages: ``messages`` for chats, ``input`` for Responses
    API requests (whose items each become one chat message after ``lead`` of them, the
    instructions). ``before``: keys that must come before that array for a body to be
    remembered or joined, since what is known was parsed with their values (``cache_salt``)."""

    def __init__(self, max_bytes: int = 32 << 20, min_bytes: int = 32 << 10,
                 per_anchor: int = 256, *, key: str = "messages",
                 before: frozenset[str] = frozenset({"cache_salt"})) -> None:
        super().__init__(max_bytes, min_bytes, per_anchor)
        self.key = key
        self._before = before
        self._check = lambda raw, entry: _begins_message(raw, entry, key)
        self._join = lambda raw, entry: _joined(raw, entry, key, before)

    def decode(self, raw: bytes, seed: int) -> tuple[dict[str, Any], Known | None]:
        """The body of ``raw`` as :func:`decode_json_object` decodes it (the same object, the
        same errors), and what an earlier body of scope ``seed`` that carried the same bytes
        up to one of its messages tells of it (None: nothing)."""
        found = self._found(raw, seed, self._check, self._join)
        if found is not None:
            return found[0], Known(found[1])
        return decode_json_object(raw), None

    def remember(self, raw: bytes, seed: int, body: dict[str, Any], history: KnownHistory,
                 joined: Known | None = None) -> None:
        """Keep ``history`` (``body``'s messages but its last, as parsed, after its ``lead``
        messages that are not in the array) for a later body of scope ``seed`` that starts
        with the same bytes up to where ``body``'s last message begins. ``joined``: what
        :meth:`decode` found for ``body``."""
        if len(raw) < self.min_bytes:
            return
        messages = body.get(self.key)
        if (not isinstance(messages, list)
                or len(history.normalized) != len(messages) - 1 + history.lead):
            return
        head: dict[str, Any] = {}
        for key, value in body.items():
            if key == self.key:
                break
            head[key] = value
        if any(key in body and key not in head for key in self._before):
            return  # one after the messages: no later body would be joined
        last = messages[-1]
        first_key = next(iter(last), None) if isinstance(last, dict) else None
        if not isinstance(first_key, str):
            return
        # The last message begins with its first key: the last such bytes in the body. That
        # they begin exactly that message, inside "messages", is checked by decoding what
        # comes before them, closed there.
        base = joined.entry if joined is not None else None
        end = raw.rfind(b"{" + orjson.dumps(first_key), base.end if base else 0)
        if end < ANCHOR_BYTES or (base is not None and end <= base.end):
            return
        if base is not None:  # only the bytes after the joined history: its end was checked
            closed = _closed(_SEAM + raw[base.end:end])
            if closed != {_SEAM_KEY: [0, *messages[len(base.messages):-1]]}:
                return
        guard, digest, anchor = marks(raw, end, seed)
        self._store.add(_Entry(
            end=end, guard=guard, digest=digest, anchor=anchor,
            # A chat's first body is checked when a next turn comes: most long chats have one,
            # and one that has none costs no second decoding.
            checked=base is not None,
            head=head, messages=tuple(messages[:-1]), known=history,
        ), replaces=base)


class Known:
    """What :meth:`ChatHistories.decode` found for a body: its leading messages as parsed."""

    __slots__ = ("entry",)

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry

    @property
    def history(self) -> KnownHistory:
        return self.entry.known


def _begins_message(raw: bytes, entry: _Entry, key: str) -> bool:
    """Whether ``raw`` up to ``entry.end`` (the bytes of ``entry``'s body up to there) is that
    body up to one of its messages, inside ``key``: decoded closed there, it is the body's
    keys before ``key`` and the messages before the end."""
    closed = _closed(raw[:entry.end])
    return bool(closed == {**entry.head, key: list(entry.messages)})


def _closed(document: bytes) -> Any:
    """``document`` (ending after an array element and its comma) with that array and the
    object around it closed, decoded (None where it does not decode)."""
    stripped = document.rstrip(b" \t\r\n")
    if not stripped.endswith(b","):
        return None
    try:
        return orjson.loads(stripped[:-1] + b"]}")
    except orjson.JSONDecodeError:
        return None


def _rest(raw: bytes, end: int, head: dict[str, Any],
          key: str) -> tuple[list[Any], dict[str, Any]] | None:
    """The messages and the keys of ``raw`` after ``end``, decoded on their own (None where
    they do not decode, or the join could differ from decoding ``raw`` whole)."""
    tail = raw[end:]
    if _NUL_ESCAPE in tail:
        return None
    document = _SEAM + tail
    try:
        value = orjson.loads(document)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    seam = value.pop(_SEAM_KEY, None)
    if not isinstance(seam, list) or key in value or any(k in head for k in value):
        return None
    messages = seam[1:]  # the end follows a comma: so does the rest, after the seam's 0
    if too_deep(document, {_SEAM_KEY: messages, **value}):
        return None
    return messages, value


def _joined(raw: bytes, entry: _Entry, key: str,
            before: frozenset[str]) -> dict[str, Any] | None:
    """The body of ``raw``, whose bytes before ``entry.end`` are those of ``entry``'s body
    (None where one of ``before`` comes after the messages)."""
    rest = _rest(raw, entry.end, entry.head, key)
    if rest is None or any(k in rest[1] for k in before):
        return None
    messages, after = rest
    return {**entry.head, key: [*entry.messages, *messages], **after}
