"""Where each token of an encoded text lies in its prompt, and long texts encoded in pieces.

The tokenizer's prefix store (:mod:`gateway.kvevents.token_prefix`) numbers a prompt's tokens
from its start and cuts it at token boundaries by character offset. A :class:`TokenRun` is one
encode of the prompt's text from some character on; a :class:`Stitched` run is a long text
encoded in pieces at once (the tokenizer runs a batch in parallel) and joined where
neighbouring pieces agree:

* each piece after the first starts ``4 * margin`` characters before its place, so that its
  first, perhaps cut, pre-token lies inside the overlap;
* two neighbours are joined at a token both start at, where the earlier piece's tokens cannot
  depend on where it was cut (at least ``margin`` characters before its end) and the later
  one has found its feet (``margin / 2`` characters after its start), and from which they
  agree on ``overlap`` tokens at the same offsets, neither inside a character;
* neighbours that never agree make :func:`encode_in_pieces` return None (the caller encodes
  the text in one piece).

Pieces also spare the tokenizer its slower pace per character on one very long text.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers

# encode_many(texts, add_special_tokens) -> their Encodings, encoded in parallel
EncodeMany = Callable[[list[str], bool], list[tokenizers.Encoding]]

NO_CHARS = 1 << 62  # the offset of a special token after the text (never a cut)


@dataclass(slots=True)
class TokenRun:
    """One encode: global token ``g`` is ``enc``'s token ``g - base``, ``ids`` its ids."""

    enc: tokenizers.Encoding
    ids: list[int]
    base: int
    shift: int  # character offset of the encoded text in the prompt
    leading: int  # special tokens before the text (offset 0)

    def start(self, g: int) -> int:
        j = g - self.base
        chars = self.enc.token_to_chars(j)
        if chars is None:
            return 0 if j < self.leading else NO_CHARS
        return int(chars[0]) + self.shift

    def end(self, g: int) -> int:
        chars = self.enc.token_to_chars(g - self.base)
        return 0 if chars is None else int(chars[1]) + self.shift

    def last_at_or_before(self, limit: int) -> int:
        """The largest global index whose token starts at or before ``limit``."""
        return last_at_or_before(self.start, self.base, self.base + len(self.ids), limit)


def last_at_or_before(start: Callable[[int], int], lo: int, hi: int, limit: int) -> int:
    """The largest index in [lo, hi) whose token starts at or before ``limit`` (lo - 1: none);
    starts do not decrease."""
    while lo < hi:
        mid = (lo + hi) // 2
        if start(mid) <= limit:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@dataclass(slots=True)
class Stitched:
    """Text encoded in pieces: global token ``g`` (``ids[g - base]``) in piece ``i``
    (``firsts[i] <= g < firsts[i + 1]``) is token ``g - firsts[i] + offsets[i]`` of
    ``pieces[i]``; ``leading`` special tokens come first (offset 0), and the special tokens
    from ``text_tokens`` on have no offset."""

    ids: list[int]
    pieces: list[TokenRun]
    firsts: list[int]
    offsets: list[int]
    leading: int
    text_tokens: int  # where trailing special tokens begin
    base: int = 0

    def _piece(self, g: int) -> tuple[TokenRun, int]:
        i = bisect.bisect_right(self.firsts, g) - 1
        return self.pieces[i], g - self.firsts[i] + self.offsets[i]

    def start(self, g: int) -> int:
        if g < self.leading:
            return 0
        if g >= self.text_tokens:
            return NO_CHARS
        piece, j = self._piece(g)
        return piece.start(j)

    def end(self, g: int) -> int:
        if g < self.leading or g >= self.text_tokens:
            return 0
        piece, j = self._piece(g)
        return piece.end(j)

    def last_at_or_before(self, limit: int) -> int:
        return last_at_or_before(self.start, self.base, self.base + len(self.ids), limit)


def encode_in_pieces(
    text: str, encode_many: EncodeMany, *, start: int, base: int, size: int, margin: int,
    overlap: int, pre: Sequence[int] = (), post: Sequence[int] = (),
) -> Stitched | None:
    """``text[start:]`` (its tokens numbered from ``base``, between the special tokens ``pre``
    and ``post``) encoded in pieces of ``size`` characters at once; None when two neighbours
    never agree."""
    back = 4 * margin
    bounds = [*range(start, len(text) - size // 2, size), len(text)]
    shifts = [start, *(b - back for b in bounds[1:-1])]
    encs = encode_many([text[a : bounds[i + 1]] for i, a in enumerate(shifts)], False)
    pieces = [TokenRun(enc, enc.ids, 0, shift, 0) for enc, shift in zip(encs, shifts, strict=True)]
    ids: list[int] = list(pre)
    firsts, offsets = [base + len(pre)], [0]
    for i in range(1, len(pieces)):
        join = _join(pieces[i - 1], pieces[i], offsets[-1], bounds[i], margin, overlap)
        if join is None:
            return None
        end_a, start_b = join
        ids.extend(pieces[i - 1].ids[offsets[-1] : end_a])
        firsts.append(base + len(ids))
        offsets.append(start_b)
    ids.extend(pieces[-1].ids[offsets[-1] :])
    text_tokens = base + len(ids)
    ids.extend(post)
    return Stitched(ids, pieces, firsts, offsets, base + len(pre), text_tokens, base)


def _join(a: TokenRun, b: TokenRun, from_a: int, bound: int, margin: int,
          overlap: int) -> tuple[int, int] | None:
    """Where to leave piece ``a`` (used from its token ``from_a``; its text ends at ``bound``)
    for piece ``b``: (a's first token not used, b's first token used), or None when they never
    agree."""
    n_a, n_b = len(a.ids), len(b.ids)
    trusted = bound - margin  # a's tokens up to here do not depend on where it was cut
    j_b = last_at_or_before(b.start, 0, n_b, b.shift + margin // 2) + 1
    while j_b < n_b - overlap:
        at = b.start(j_b)
        if at > trusted:
            return None
        j_a = last_at_or_before(a.start, from_a, n_a, at)
        if (j_a > from_a and a.start(j_a) == at and j_a + overlap < n_a
                and a.start(j_a + overlap) <= trusted
                and at >= a.end(j_a - 1) and at >= b.end(j_b - 1)
                and a.ids[j_a : j_a + overlap] == b.ids[j_b : j_b + overlap]
                and all(a.start(j_a + t) == b.start(j_b + t) for t in range(1, overlap))):
            return j_a, j_b
        j_b += 1
    return None
