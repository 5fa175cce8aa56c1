"""Long request bodies remembered by their leading bytes, for a later body that repeats them.

A client that keeps a conversation or an agent's context sends it whole on every turn: the next
body is this one, byte for byte, up to a point (where the new messages begin, or where the
prompt text grows), then more. :class:`BodyPrefixes` is the store under
:mod:`gateway.chat_histories` and :mod:`gateway.prompt_histories`: entries that stand for a
body's first ``end`` bytes, found again by a keyed hash of a body's first bytes (the anchor),
told apart by the bytes just before their end (a comparison), and only then hashed up to their
end. What an entry knows of those bytes (decoded messages, a decoded prompt) is its subclass's.

Scoped by a seed (:func:`scope`: a tenant and the normalization options): one tenant's bodies
never make another's faster. Bounded by the bytes of the bodies the entries stand for; the one
used least recently goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import xxhash

ANCHOR_BYTES = 1024  # an entry's end is past these: its anchor is a hash of them
GUARD_BYTES = 32
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(slots=True, eq=False)
class Prefix:
    end: int  # the bytes of the body this entry stands for
    guard: bytes  # the bytes just before ``end``
    digest: int  # keyed hash of the body before ``end``
    anchor: int  # keyed hash of the body's first ANCHOR_BYTES
    # That the body up to ``end`` is what the entry says of it, checked (a first body is
    # checked when a later body is found by it: most long conversations have a next turn).
    checked: bool


def scope(tenant: str, options: object) -> int:
    """The seed of one tenant under one set of normalization options."""
    return xxhash.xxh3_64_intdigest(tenant.encode("utf-8", "surrogatepass"),
                                    seed=hash(options) & _SEED_MASK)


def marks(raw: bytes, end: int, seed: int) -> tuple[bytes, int, int]:
    """The guard, digest and anchor of an entry that stands for ``raw[:end]``."""
    view = memoryview(raw)
    return (raw[end - GUARD_BYTES:end], xxhash.xxh3_64_intdigest(view[:end], seed=seed),
            xxhash.xxh3_64_intdigest(view[:ANCHOR_BYTES], seed=seed))


P = TypeVar("P", bound=Prefix)


class BodyPrefixes(Generic[P]):
    """Entries of one kind, by digest and by anchor, within ``max_bytes``."""

    def __init__(self, max_bytes: int, per_anchor: int = 256) -> None:
        self.max_bytes = max_bytes
        self.per_anchor = per_anchor
        self._entries: OrderedDict[int, P] = OrderedDict()  # by digest, least recent first
        self._anchors: dict[int, list[P]] = {}
        self._bytes = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[P]:
        return iter(self._entries.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of the bodies the entries stand for (up to their ends)."""
        return self._bytes

    def find(self, raw: bytes, seed: int) -> P | None:
        """The most recent entry of scope ``seed`` whose bytes ``raw`` begins with and goes
        on past (None: none)."""
        if not self._anchors or len(raw) <= ANCHOR_BYTES:
            return None
        entries = self._anchors.get(
            xxhash.xxh3_64_intdigest(memoryview(raw)[:ANCHOR_BYTES], seed=seed))
        for entry in reversed(entries or ()):  # the most recent first
            end = entry.end
            if (end < len(raw) and raw[end - GUARD_BYTES:end] == entry.guard
                    and xxhash.xxh3_64_intdigest(memoryview(raw)[:end], seed=seed)
                    == entry.digest):
                return entry
        return None

    def used(self, entry: P) -> None:
        """``entry`` answered a body: it is the most recently used."""
        self._entries.move_to_end(entry.digest)
        self.hits += 1

    def add(self, entry: P, replaces: P | None = None) -> None:
        """Keep ``entry``; a conversation's next turn replaces the entry its body was joined
        to (``replaces``): its latest is kept."""
        for old in (self._entries.get(entry.digest), replaces):
            if old is not None and self._entries.get(old.digest) is old:
                self.evict(old)
        self._entries[entry.digest] = entry
        same = self._anchors.setdefault(entry.anchor, [])
        same.append(entry)
        self._bytes += entry.end
        if len(same) > self.per_anchor:
            self.evict(same[0])
        while self._bytes > self.max_bytes:
            self.evict(next(iter(self._entries.values())))

    def evict(self, entry: P) -> None:
        del self._entries[entry.digest]
        self._bytes -= entry.end
        same = self._anchors[entry.anchor]
        same.remove(entry)
        if not same:
            del self._anchors[entry.anchor]


class BodyMemo(Generic[P]):
    """What a memo of long bodies of one kind shares: its store, its bounds and how a body
    is found by an entry, checked and joined to it (:meth:`_found`)."""

    seed = staticmethod(scope)

    def __init__(self, max_bytes: int = 32 << 20, min_bytes: int = 32 << 10,
                 per_anchor: int = 256) -> None:
        self.max_bytes = max_bytes  # the bodies' bytes the entries stand for, at most
        self.min_bytes = min_bytes  # shorter bodies are decoded whole
        self._store: BodyPrefixes[P] = BodyPrefixes(max_bytes, per_anchor)

    def __len__(self) -> int:
        return len(self._store)

    @property
    def hits(self) -> int:
        return self._store.hits

    @property
    def held_bytes(self) -> int:
        """Bytes of the bodies the entries stand for (up to their ends)."""
        return self._store.held_bytes

    def _found(self, raw: bytes, seed: int, check: Callable[[bytes, P], bool],
               join: Callable[[bytes, P], dict[str, Any] | None],
               ) -> tuple[dict[str, Any], P] | None:
        """The body of ``raw`` joined to the entry of scope ``seed`` it begins with, and that
        entry (None: none, or the join could differ from decoding it whole). An entry not yet
        checked is checked against ``raw`` first (``check``), and dropped if it fails."""
        entry = self._store.find(raw, seed) if len(raw) >= self.min_bytes else None
        if entry is None:
            return None
        if not entry.checked and not check(raw, entry):
            self._store.evict(entry)
            return None
        entry.checked = True
        body = join(raw, entry)
        if body is None:
            return None
        self._store.used(entry)
        return body, entry
