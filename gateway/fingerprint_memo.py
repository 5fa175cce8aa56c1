"""Keys of long prompts fingerprinted recently, so that a prompt extending one is hashed past it.

An agent sends its whole context on every turn: the next prompt is the last one and more.
:func:`gateway.fingerprint.fingerprint` hashes a prompt whole, at memory speed on ASCII text
but about 1 ns a character on text that is not (each segment is encoded to UTF-8 first): on a
prompt of 640,000 characters with a typographic quote here and there, half a millisecond a
turn for text it hashed the turn before. :class:`FingerprintMemo` keeps recent keys with their
texts, per namespace and opening (the first ``min_chars`` characters); a prompt that begins
with one of those texts takes that key's checkpoints and hashes only what follows. The keys
are the same as :func:`fingerprint`'s.

Agents of one deployment share their opening: the same system prompt and tool list, often
more than ``min_chars`` long, come first in every session's context. So an opening keeps the
last text of each of up to ``per_opening`` sessions (each session's next turn replaces its
last), and a prompt is compared first by the few characters where each kept text ends (a
slice each), then whole (a memcmp) only where those match: many sessions cost a short scan,
not a comparison through the shared prefix each.

Per namespace (tenant, model, cache salt): one tenant's prompts never make another's faster.
The texts are held in this process's memory only, within ``max_bytes`` (as CPython stores
them; often the very strings the request's parse made, kept a little longer); the least
recently used text goes first.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.fingerprint import FingerprintOptions, Namespace, PrefixKey, fingerprint
from gateway.normal_texts import stored_bytes

# Texts kept per namespace and opening: the last turn of as many agent sessions sharing it.
PER_OPENING = 128
# Characters compared at the end of a kept text before the whole of it.
_GUARD = 32

_Opening = tuple[int, FingerprintOptions, int]


class FingerprintMemo:
    def __init__(self, max_bytes: int = 32 << 20, min_chars: int = 8192,
                 per_opening: int = PER_OPENING) -> None:
        self.max_bytes = max_bytes
        self.min_chars = min_chars
        self.per_opening = per_opening
        # Kept texts by opening, the most recent first (entry numbers), and every entry,
        # the least recently used first.
        self._openings: dict[_Opening, list[int]] = {}
        self._entries: OrderedDict[int, tuple[_Opening, str, PrefixKey]] = OrderedDict()
        self._next = 0
        self.held_bytes = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def fingerprint(self, text: str, namespace: Namespace,
                    opts: FingerprintOptions) -> PrefixKey:
        """:func:`fingerprint` of ``text``, hashed past the most recent kept text it begins
        with (which this text then replaces)."""
        if len(text) < self.min_chars or not self.max_bytes:
            return fingerprint(text, namespace, opts)
        opening = (namespace.seed(), opts, hash(text[:self.min_chars]))
        kept = self._openings.setdefault(opening, [])
        entries = self._entries
        size = len(text)
        prior = None
        for number in kept:
            _, earlier, earlier_key = entries[number]
            end = len(earlier)
            if (end <= size and text[max(0, end - _GUARD):end] == earlier[-_GUARD:]
                    and text.startswith(earlier)):
                prior = earlier_key
                # This text's next turn will extend this text, not the one it extends.
                kept.remove(number)
                self.held_bytes -= stored_bytes(entries.pop(number)[1])
                break
        key = fingerprint(text, namespace, opts, prior)
        self.hits += prior is not None
        number, self._next = self._next, self._next + 1
        kept.insert(0, number)
        entries[number] = (opening, text, key)
        self.held_bytes += stored_bytes(text)
        if len(kept) > self.per_opening:
            self.held_bytes -= stored_bytes(entries.pop(kept.pop())[1])
        while self.held_bytes > self.max_bytes and entries:
            _, (old_opening, old_text, _) = entries.popitem(last=False)
            self.held_bytes -= stored_bytes(old_text)
            left = self._openings[old_opening]
            left.pop()  # the least recently used entry is its opening's last
            if not left:
                del self._openings[old_opening]
        return key
