"""Keys of long prompts fingerprinted recently, so that a prompt extending one is hashed past it.

An agent sends its whole context on every turn: the next prompt is the last one and more.
:func:`gateway.fingerprint.fingerprint` hashes a prompt whole, at memory speed on ASCII text
but about 1 ns a character on text that is not (each segment is encoded to UTF-8 first): on a
prompt of 640,000 characters with a typographic quote here and there, half a millisecond a
turn for text it hashed the turn before. :class:`FingerprintMemo` keeps the last keys per
namespace and opening (the first ``min_chars`` characters) with their texts; a prompt that
begins with one of those texts (compared, not hashed: a memcmp) takes that key's checkpoints
and hashes only what follows. The keys are the same as :func:`fingerprint`'s.

Per namespace (tenant, model, cache salt): one tenant's prompts never make another's faster.
The texts are held in this process's memory only, within ``max_bytes`` (as CPython stores
them; often the very strings the request's parse made, kept a little longer).
"""

from __future__ import annotations

from gateway.fingerprint import FingerprintOptions, Namespace, PrefixKey, fingerprint
from gateway.normal_texts import stored_bytes

# Texts kept per namespace and opening: an agent's last turn, and one other it forked from.
_PER_OPENING = 2


class FingerprintMemo:
    def __init__(self, max_bytes: int = 32 << 20, min_chars: int = 8192) -> None:
        self.max_bytes = max_bytes
        self.min_chars = min_chars
        self._texts: dict[tuple[int, FingerprintOptions, int],
                          tuple[tuple[str, PrefixKey], ...]] = {}
        self.held_bytes = 0
        self.hits = 0

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._texts.values())

    def fingerprint(self, text: str, namespace: Namespace,
                    opts: FingerprintOptions) -> PrefixKey:
        """:func:`fingerprint` of ``text``, hashed past the longest kept text it begins with."""
        if len(text) < self.min_chars or not self.max_bytes:
            return fingerprint(text, namespace, opts)
        opening = (namespace.seed(), opts, hash(text[:self.min_chars]))
        kept = self._texts.pop(opening, ())
        # Which kept texts this one begins with (each compared once: a memcmp of up to the
        # whole prompt).
        begins = [len(earlier) <= len(text) and text.startswith(earlier) for earlier, _ in kept]
        prior = next((key for (_, key), yes in zip(kept, begins, strict=True) if yes), None)
        key = fingerprint(text, namespace, opts, prior)
        self.hits += prior is not None
        # This text first; a kept text it extends is no longer needed (the next turn extends
        # this one), nor one it equals.
        others = tuple(pair for pair, yes in zip(kept, begins, strict=True) if not yes)
        now = ((text, key), *others)[:_PER_OPENING]
        self.held_bytes += _bytes(now) - _bytes(kept)
        self._texts[opening] = now
        while self.held_bytes > self.max_bytes and self._texts:
            self.held_bytes -= _bytes(self._texts.pop(next(iter(self._texts))))
        return key


def _bytes(kept: tuple[tuple[str, PrefixKey], ...]) -> int:
    """About the bytes CPython stores the kept texts' characters in."""
    return sum(stored_bytes(t) for t, _ in kept)
