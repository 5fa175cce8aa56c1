"""Long prompt texts already found normal, remembered by keyed hash (never the text).

:func:`gateway.normalize.normalize_text` checks every text against its rules; a context
re-sent turn after turn (a system prompt, a tool list, a conversation's history, a shared
document) would be checked again on every request. :class:`NormalTexts` remembers the long
texts the rules left as they were, so that such a text costs one hash.
"""

from __future__ import annotations

import sys
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


class NormalTexts:
    """Long texts the rules left as they were, remembered by a keyed 64-bit hash of each
    (never the text), so that a text sent again is not checked again.

    A context re-sent turn after turn (a system prompt, a tool list, a conversation's
    history, a shared document) is checked once; after that it costs the gateway one hash, at
    memory speed, instead of the rules' checks (1 ns a character on ASCII text, 5 on text
    that is not). Keys are scoped (:meth:`scope`: the tenant and its cache salt), so one tenant's
    texts never make another's faster. A collision could only leave a text as the client
    wrote it. Bounded: the key seen least recently goes first.
    """

    def __init__(self, capacity: int = 4096, min_chars: int = 8192) -> None:
        self.capacity = capacity
        self.min_chars = min_chars  # shorter texts are checked faster than hashed
        self._keys: dict[int, None] = {}
        self.hits = 0

    def __len__(self) -> int:
        return len(self._keys)

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

    def add(self, key: int) -> None:
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            del self._keys[next(iter(self._keys))]


class TextScope:
    """One scope's view of :class:`NormalTexts`; its seed is hashed from the scope's names
    when a text first needs a key (most requests hold no long text)."""

    __slots__ = ("_names", "_seed", "texts")

    def __init__(self, texts: NormalTexts, names: tuple[str, ...]) -> None:
        self.texts = texts
        self._names = names
        self._seed = -1

    def key(self, text: str, opts: NormalizeOptions) -> int:
        if self._seed < 0:
            self._seed = xxhash.xxh3_64_intdigest(
                "\x1f".join(self._names).encode("utf-8", "surrogatepass"))
        # Encoded as CPython stores the text where it can: a copy at memory speed.
        if text.isascii():
            data = text.encode("ascii")
        else:
            width = char_width(text)
            codec = "latin-1" if width == 1 else "utf-16-le" if width < 4 else "utf-32-le"
            data = text.encode(codec, "surrogatepass")
        return xxhash.xxh3_64_intdigest(data, seed=self._seed ^ hash(opts) & _SEED_MASK)
