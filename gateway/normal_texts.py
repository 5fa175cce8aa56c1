"""Long prompt texts already found normal, remembered by keyed hash (never the text).

:func:`gateway.normalize.normalize_text` checks every text against its rules; a context
re-sent turn after turn (a system prompt, a tool list, a conversation's history, a shared
document) would be checked again on every request. :class:`NormalTexts` remembers the long
texts the rules left as they were, so that such a text costs one hash, and a text that
extends one of them is checked past it only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from gateway.normalize import NormalizeOptions

# The header of a compact string of one byte a character: what ``sys.getsizeof`` counts
# beside the characters.
_COMPACT_HEADER = sys.getsizeof("\xe9") - 2


def char_width(text: str) -> int:
    """At least the bytes a character CPython stores non-ASCII ``text`` with (1, 2 or 4), read
    from its size in constant time. It can only overstate the width: a cached UTF-8 copy of
    the text adds to the size, never takes from it."""
    return (sys.getsizeof(text) - _COMPACT_HEADER) // (len(text) + 1)


_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF


def stored_bytes(text: str) -> int:
    """About the bytes CPython stores ``text``'s characters in."""
    return len(text) * (1 if text.isascii() else char_width(text))


# Texts remembered per opening, and how many of them a longer text is compared with.
_TEXTS_PER_OPENING = 4


class NormalTexts:
    """Long texts the rules left as they were, remembered by a keyed 64-bit hash of each
    (never the text), so that a text sent again is not checked again; and, within a budget of
    bytes, long texts the rules rewrote, with what they made of them.

    A context re-sent turn after turn (a system prompt, a tool list, a conversation's
    history, a shared document) is checked once; after that it costs the gateway one hash, at
    memory speed, instead of the rules' checks (1 ns a character on ASCII text, 5 on text
    that is not). A text that begins with a remembered one and goes on (a completions
    agent's next prompt: its last prompt and more) is checked from that text's last line
    on: a few hashes at memory speed and the rules on what is new. A context re-rendered with
    spaces at the ends of its lines was rewritten by the rules on every request; such a text
    is kept with its rewriting (``rewritten_bytes`` of both, in the process's memory only,
    like the request), so that it is rewritten once, and its rewriting is used only for that
    very text or one that begins with it (compared, not only hashed). Keys are scoped
    (:meth:`scope`: the tenant and its cache salt, and the rules), so one tenant's texts never
    make another's faster. A collision of keys could only leave a text as the client wrote
    it. Bounded: the key (the opening, the rewritten text) seen least recently goes first.
    """

    def __init__(self, capacity: int = 4096, min_chars: int = 8192,
                 rewritten_bytes: int = 32 << 20) -> None:
        self.capacity = capacity
        self.min_chars = min_chars  # shorter texts are checked faster than hashed
        self.rewritten_bytes = rewritten_bytes
        self._keys: dict[int, None] = {}
        # A text's opening (a keyed hash of its first min_chars characters) -> the remembered
        # texts that open so, as (stored bytes, key, rewritten), newest first: a prompt that
        # extends one of them (a completions agent's next turn) is checked past it only.
        self._openings: dict[int, tuple[tuple[int, int, bool], ...]] = {}
        # Key of a text the rules rewrote -> the text, what they made of it, and the length of
        # the part of that made of the text's lines before its last one. The text is compared
        # before its rewriting is used: a key's collision must not hand a request another
        # request's text.
        self._rewritten: dict[int, tuple[str, str, int]] = {}
        self.held_bytes = 0
        self.hits = 0
        self.prefix_hits = 0

    def __len__(self) -> int:
        return len(self._keys) + len(self._rewritten)

    def scope(self, *names: str) -> TextScope:
        """The keys of one scope (e.g. a tenant and its cache salt)."""
        return TextScope(self, names)

    def known(self, key: int) -> bool:
        if key not in self._keys:
            return False
        del self._keys[key]  # most recently seen last
        self._keys[key] = None
        self.hits += 1
        return True

    def rewriting(self, key: int, text: str, whole: bool = True) -> tuple[str, int] | None:
        """What the rules made of the remembered text of ``key`` and the length of its part
        before that text's last line, if ``text`` is that text (``whole``: a request's text
        sent again, counted as a text not checked again) or begins with it."""
        found = self._rewritten.get(key)
        if found is None:
            return None
        original, rewritten, head = found
        if not (text == original if whole else text.startswith(original)):
            return None
        del self._rewritten[key]
        self._rewritten[key] = found  # most recently seen last
        self.hits += whole
        return rewritten, head

    def add(self, key: int, opening: int | None = None, stored: int = 0) -> None:
        """Remember ``key``; with ``opening``, also as a text of ``stored`` bytes that a
        longer text may begin with."""
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            del self._keys[next(iter(self._keys))]
        if opening is not None:
            self._opened(opening, stored, key, False)

    def add_rewritten(self, key: int, opening: int, stored: int, text: str, rewritten: str,
                      head: int) -> None:
        """Remember that the rules made ``rewritten`` of ``text`` (key ``key``, ``stored``
        bytes, opening with ``opening``), ``head`` characters of it from the lines before the
        text's last one; not if the two alone are over the budget."""
        size = stored_bytes(text) + stored_bytes(rewritten)
        if size > self.rewritten_bytes:
            return
        old = self._rewritten.pop(key, None)
        if old is not None:
            self.held_bytes -= stored_bytes(old[0]) + stored_bytes(old[1])
        self._rewritten[key] = (text, rewritten, head)
        self.held_bytes += size
        while self.held_bytes > self.rewritten_bytes or len(self._rewritten) > self.capacity:
            gone = self._rewritten.pop(next(iter(self._rewritten)))
            self.held_bytes -= stored_bytes(gone[0]) + stored_bytes(gone[1])
        self._opened(opening, stored, key, True)

    def _opened(self, opening: int, stored: int, key: int, rewritten: bool) -> None:
        texts = self._openings.pop(opening, ())
        self._openings[opening] = ((stored, key, rewritten), *texts[:_TEXTS_PER_OPENING - 1])
        if len(self._openings) > self.capacity:
            del self._openings[next(iter(self._openings))]

    def begun(self, opening: int) -> tuple[tuple[int, int, bool], ...]:
        """The remembered texts that open with ``opening``, as (stored bytes, key,
        rewritten), newest first."""
        return self._openings.get(opening, ())


class TextScope:
    """One scope's view of :class:`NormalTexts`; its seed is hashed from the scope's names
    when a text first needs a key (most requests hold no long text)."""

    __slots__ = ("_names", "_seed", "texts")

    def __init__(self, texts: NormalTexts, names: tuple[str, ...]) -> None:
        self.texts = texts
        self._names = names
        self._seed = -1

    def look(self, text: str, opts: NormalizeOptions) -> Look:
        """Whether ``text`` (at least ``min_chars`` long) is remembered under ``opts``, else
        how much of it is: the longest remembered text it begins with. Reads the text as
        CPython stores it where it can (a copy at memory speed), freed on return."""
        if self._seed < 0:
            self._seed = xxhash.xxh3_64_intdigest(
                "\x1f".join(self._names).encode("utf-8", "surrogatepass"))
        if text.isascii():
            data = text.encode("ascii")
        else:
            width = char_width(text)
            codec = "latin-1" if width == 1 else "utf-16-le" if width < 4 else "utf-32-le"
            data = text.encode(codec, "surrogatepass")
        seed = self._seed ^ hash(opts) & _SEED_MASK
        key = xxhash.xxh3_64_intdigest(data, seed=seed)
        texts = self.texts
        if texts.known(key):
            return Look(key, 0, len(data), known=True, prefix=len(text))
        rewriting = texts.rewriting(key, text)
        if rewriting is not None:
            return Look(key, 0, len(data), known=True, prefix=len(text), output=rewriting[0])
        width = len(data) // len(text)
        view = memoryview(data)
        opening = xxhash.xxh3_64_intdigest(view[:texts.min_chars * width], seed=seed)
        for size, other, rewritten in sorted(texts.begun(opening), reverse=True):
            if size >= len(data) or xxhash.xxh3_64_intdigest(view[:size], seed=seed) != other:
                continue
            head = None
            if rewritten:
                earlier = texts.rewriting(other, text, whole=False)
                if earlier is None:
                    continue  # its rewriting is no longer held (or another text's key)
                head = earlier[0][:earlier[1]]
            texts.prefix_hits += 1
            return Look(key, opening, len(data), known=False, prefix=size // width, head=head)
        return Look(key, opening, len(data), known=False, prefix=0)


@dataclass(frozen=True, slots=True)
class Look:
    """What :meth:`TextScope.look` found of a text: its key, the key of its opening, its size
    as stored, whether it is remembered (``output``: what the rules made of it, if they
    rewrote it), else the characters it begins with that are (``head``: what the rules made
    of that text's lines before its last one, if they rewrote it)."""

    key: int
    opening: int
    size: int
    known: bool
    prefix: int
    output: str | None = None
    head: str | None = None

    def remember(self, texts: NormalTexts, text: str, rewritten: str | None = None,
                 head: int = 0) -> None:
        """Remember ``text``, found normal, or (``rewritten``) what the rules made of it,
        ``head`` characters of it from the text's lines before its last one."""
        if rewritten is None:
            texts.add(self.key, self.opening, self.size)
        else:
            texts.add_rewritten(self.key, self.opening, self.size, text, rewritten, head)
