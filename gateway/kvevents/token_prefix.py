"""Token-exact keys of a prompt that extends one tokenized before, for the price of its new text.

An agent session or a chat re-sends its whole context each turn, a few thousand tokens longer
than the last; a RAG question re-sends its document. Tokenizing all of it again costs the
gateway time linear in the context (milliseconds per 10 KB with a small vocabulary), on every
request. The store remembers, per cache namespace, what earlier prompts came to in tokens, in
segments between checkpoints, and tokenizes only what lies past the deepest one a prompt shares:

* **Checkpoints** sit every ``stride`` characters. Checkpoint ``k`` is named by a chained hash
  of the text before it, seeded by the namespace and by whether special tokens were added, so
  two prompts share it exactly when they share that text. Tenants never share a segment, nor the
  time one would save.
* **A segment** ends at a *cut*: the last token boundary at least ``margin`` characters before
  its checkpoint with a whole number of KV blocks of tokens before it. It keeps the chain keys
  of its blocks, where it starts and ends in the text and its last ``overlap`` tokens with their
  offsets. Text after the checkpoint cannot have changed how the text before the cut was
  tokenized, unless one pre-token ran across the margin; the check below catches that.
* **Exact by check, not by assumption**: a prompt that reuses segments is encoded from
  ``overlap`` tokens before the last cut. The result is used only when those tokens come out
  the same at the same offsets and the next token starts at the cut; otherwise from the cut
  before, and after three failed cuts whole (:attr:`PrefixStoreStats.mismatches` counts them).
  Byte-level and whitespace pre-tokenized BPE tokenizers pass. One that fails (a normalizer
  that writes a marker in front of any text it is given) gets every prompt encoded whole.
* **A long text to encode** (a prompt seen for the first time, or a long new text after a
  known prefix: at least ``2 * chunk_chars`` characters) is encoded in pieces at once, which
  the tokenizer runs in parallel. Each piece
  after the first starts a little before its place. Two neighbours are joined at a token
  both start at, well inside their overlap, from which they agree on ``overlap`` tokens at the
  same offsets; if they never agree the prompt is encoded whole. Pieces also spare the
  tokenizer its slower pace on one very long text: 800,000 characters take 90-100 ms instead
  of 230-320.
* Bounded: at most ``max_segments`` segments, the least recently used dropped first.

Only token ids and hashes are kept, never text. The event loop and the tokenizer pool's threads
share the store; a lock guards its table, never an encode.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers
import xxhash

from gateway.contracts.kv_keys import token_block_keys

# encode(text, add_special_tokens) -> its Encoding
Encode = Callable[[str, bool], tokenizers.Encoding]
# encode_many(texts, add_special_tokens) -> their Encodings, encoded in parallel
EncodeMany = Callable[[list[str], bool], list[tokenizers.Encoding]]

# One piece of a prompt encoded in pieces: its Encoding, ids and character offset.
_Piece = tuple[tokenizers.Encoding, list[int], int]

_NO_CHARS = 1 << 62  # the offset given to a special token after the text (never a cut)
_TRIES = 3  # cuts tried, from the deepest back, before a prompt is encoded whole


@dataclass(frozen=True, slots=True)
class PrefixStoreOptions:
    stride: int = 1024  # characters between checkpoints
    margin: int = 128  # characters a cut keeps before its checkpoint
    overlap: int = 8  # tokens encoded again before a cut, to check it
    max_segments: int = 65_536  # 0: off; 64 MB of prompt text in about 50 MB
    # A prompt with nothing to reuse and at least twice this many characters is encoded in
    # pieces of this size, in parallel, and stitched where neighbours agree (0: never).
    chunk_chars: int = 32_768

    def __post_init__(self) -> None:
        if self.stride < 1 or self.overlap < 1 or self.max_segments < 0:
            raise ValueError("stride and overlap must be >= 1, max_segments >= 0")
        if not 0 <= self.margin < self.stride:
            raise ValueError("margin must be >= 0 and below stride")
        if self.chunk_chars and self.chunk_chars < 4 * self.stride:
            raise ValueError("chunk_chars must be 0 or at least 4 strides")


@dataclass(frozen=True, slots=True)
class _Segment:
    start: int  # character offset of its first token (the previous cut)
    end: int  # its cut
    tokens: int  # tokens before the cut, from the prompt's start (whole blocks)
    keys: array[int]  # chain keys of its blocks
    tail_ids: array[int]  # the last `overlap` tokens before the cut (more where the first
    tail_starts: array[int]  # would be inside a character), and their character offsets


@dataclass(slots=True)
class PrefixStoreStats:
    lookups: int = 0
    reused: int = 0  # prompts encoded from a cut
    reused_tokens: int = 0  # tokens those did not encode again
    mismatches: int = 0  # a cut failed its check, or two pieces never agreed
    pieced: int = 0  # prompts encoded in pieces, in parallel
    stored: int = 0  # segments stored
    evicted: int = 0


@dataclass(frozen=True, slots=True)
class Encoded:
    keys: list[int]  # chain keys of the prompt's whole blocks
    tokens: int  # its length in tokens
    short_ids: tuple[int, ...]  # its tokens when it fills no whole block, else ()


@dataclass(slots=True)
class _Run:
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
            return 0 if j < self.leading else _NO_CHARS
        return int(chars[0]) + self.shift

    def end(self, g: int) -> int:
        chars = self.enc.token_to_chars(g - self.base)
        return 0 if chars is None else int(chars[1]) + self.shift

    def last_at_or_before(self, limit: int) -> int:
        """The largest global index whose token starts at or before ``limit``."""
        return _last_at_or_before(self.start, self.base, self.base + len(self.ids), limit)


def _last_at_or_before(start: Callable[[int], int], lo: int, hi: int, limit: int) -> int:
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
class _Stitched:
    """Text encoded in pieces: global token ``g`` (``ids[g - base]``) in piece ``i``
    (``firsts[i] <= g < firsts[i + 1]``) is token ``g - firsts[i] + offsets[i]`` of
    ``encs[i]``, whose text starts at character ``shifts[i]``; ``leading`` special tokens come
    first (offset 0), and the special tokens from ``text_tokens`` on have no offset."""

    ids: list[int]
    encs: list[tokenizers.Encoding]
    firsts: list[int]
    offsets: list[int]
    shifts: list[int]
    leading: int
    text_tokens: int  # leading + the text's tokens: where trailing special tokens begin
    base: int = 0

    def _chars(self, g: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self.firsts, g) - 1
        chars = self.encs[i].token_to_chars(g - self.firsts[i] + self.offsets[i])
        return None if chars is None else (int(chars[0]) + self.shifts[i],
                                           int(chars[1]) + self.shifts[i])

    def start(self, g: int) -> int:
        if g < self.leading:
            return 0
        if g >= self.text_tokens:
            return _NO_CHARS
        chars = self._chars(g)
        return 0 if chars is None else chars[0]

    def end(self, g: int) -> int:
        if g < self.leading or g >= self.text_tokens:
            return 0
        chars = self._chars(g)
        return 0 if chars is None else chars[1]

    def last_at_or_before(self, limit: int) -> int:
        return _last_at_or_before(self.start, self.base, self.base + len(self.ids), limit)


class TokenPrefixStore:
    def __init__(self, encode: Encode, block_size: int,
                 opts: PrefixStoreOptions = PrefixStoreOptions(),
                 encode_many: EncodeMany | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self._encode = encode
        self._encode_many = encode_many
        self._block = block_size
        self.opts = opts
        self.stats = PrefixStoreStats()
        self._segments: OrderedDict[int, _Segment] = OrderedDict()
        self._lock = threading.Lock()
        # Special tokens the tokenizer adds around a text; None when they are not a plain
        # prefix and suffix of its tokens (then such prompts are always encoded whole).
        self._affixes = _special_affixes(encode)

    def __len__(self) -> int:
        return len(self._segments)

    def encode(self, text: str, *, special: bool, seed: int) -> Encoded:
        """The chain keys (from ``seed``) and the length of ``text`` encoded with or without
        the tokenizer's special tokens, exactly as one encode of the whole text gives them."""
        usable = self.opts.max_segments > 0 and (not special or self._affixes is not None)
        names = self._names(text, special, seed) if usable else []
        found = self._lookup(names) if names else []
        self.stats.lookups += 1
        for _ in range(_TRIES):
            if not found:
                break
            resumed = self._resume(text, found, special)
            if resumed is not None:
                self.stats.reused += 1
                self.stats.reused_tokens += found[-1].tokens
                self._store(names, found, resumed[0], resumed[1])
                return Encoded(resumed[1], resumed[2], ())
            self.stats.mismatches += 1
            found = found[:-1]  # the cut before
        run: _Run | _Stitched | None = self._encode_in_pieces(text, special)
        if run is None:  # short, or pieces that did not agree
            enc = self._encode(text, special)
            leading = len(self._affixes[0]) if special and self._affixes else 0
            run = _Run(enc, enc.ids, 0, 0, leading)
        ids = run.ids
        keys = token_block_keys(ids, self._block, seed)
        if names:
            self._store(names, [], run, keys)
        return Encoded(keys, len(ids), () if keys else tuple(ids))

    # -- a long prompt seen for the first time ---------------------------------------------------
    def _encode_in_pieces(self, text: str, special: bool, start: int = 0,
                          base: int = 0) -> _Stitched | None:
        """``text[start:]`` (its tokens numbered from ``base``) encoded in pieces of
        ``chunk_chars`` at once (the tokenizer runs them in parallel), each but the first from
        ``4 * margin`` characters before its place. Two neighbours are joined at a token both
        start at, well inside their overlap, from which they agree on ``overlap`` tokens at
        the same offsets. None where the text is short, pieces cannot be encoded together, or
        two neighbours never agree (then it is encoded in one piece; ``stats.mismatches``
        counts it). ``special`` adds the tokenizer's special tokens (``start`` 0 only)."""
        opts, many = self.opts, self._encode_many
        size = opts.chunk_chars
        if many is None or not size or len(text) - start < 2 * size:
            return None
        if special and (self._affixes is None or start):
            return None
        pre, post = self._affixes if special and self._affixes else ((), ())
        back = 4 * opts.margin
        bounds = [*range(start, len(text) - size // 2, size), len(text)]
        shifts = [start, *(b - back for b in bounds[1:-1])]
        encs = many([text[a : bounds[i + 1]] for i, a in enumerate(shifts)], False)
        pieces = [enc.ids for enc in encs]
        ids: list[int] = list(pre)
        firsts, offsets = [base + len(pre)], [0]
        for i in range(1, len(encs)):
            join = self._join((encs[i - 1], pieces[i - 1], shifts[i - 1]),
                              (encs[i], pieces[i], shifts[i]), offsets[-1], bounds[i])
            if join is None:
                self.stats.mismatches += 1
                return None
            end_a, start_b = join
            ids.extend(pieces[i - 1][offsets[-1] : end_a])
            firsts.append(base + len(ids))
            offsets.append(start_b)
        ids.extend(pieces[-1][offsets[-1] :])
        self.stats.pieced += 1
        text_tokens = base + len(ids)
        ids.extend(post)
        return _Stitched(ids, encs, firsts, offsets, shifts, base + len(pre), text_tokens, base)

    def _join(self, a: _Piece, b: _Piece, from_a: int, bound: int) -> tuple[int, int] | None:
        """Where to leave piece ``a`` (used from its token ``from_a``; its text ends at
        ``bound``) for piece ``b``: (a's first token not used, b's first token used), or
        None when they never agree."""
        overlap, margin = self.opts.overlap, self.opts.margin
        (enc_a, ids_a, shift_a), (enc_b, ids_b, shift_b) = a, b

        def start(enc: tokenizers.Encoding, shift: int, j: int) -> int:
            chars = enc.token_to_chars(j)
            return _NO_CHARS if chars is None else int(chars[0]) + shift

        def end(enc: tokenizers.Encoding, shift: int, j: int) -> int:
            chars = enc.token_to_chars(j)
            return 0 if chars is None else int(chars[1]) + shift

        def start_a(j: int) -> int:
            return start(enc_a, shift_a, j)

        def start_b(j: int) -> int:
            return start(enc_b, shift_b, j)

        n_a, n_b = len(ids_a), len(ids_b)
        trusted = bound - margin  # a's tokens up to here do not depend on where it was cut
        j_b = _last_at_or_before(start_b, 0, n_b, shift_b + margin // 2) + 1
        while j_b < n_b - overlap:
            at = start_b(j_b)
            if at > trusted:
                return None
            j_a = _last_at_or_before(start_a, from_a, n_a, at)
            if (j_a > from_a and start_a(j_a) == at and j_a + overlap < n_a
                    and start_a(j_a + overlap) <= trusted
                    and at >= end(enc_a, shift_a, j_a - 1) and at >= end(enc_b, shift_b, j_b - 1)
                    and ids_a[j_a : j_a + overlap] == ids_b[j_b : j_b + overlap]
                    and all(start_a(j_a + t) == start_b(j_b + t) for t in range(1, overlap))):
                return j_a, j_b
            j_b += 1
        return None

    # -- lookup --------------------------------------------------------------------------------
    def _names(self, text: str, special: bool, seed: int) -> list[int]:
        """Hashes naming the text before each checkpoint."""
        stride = self.opts.stride
        h = xxhash.xxh3_64_intdigest(b"special" if special else b"plain", seed=seed)
        names = []
        for k in range(len(text) // stride):
            chunk = text[k * stride : (k + 1) * stride].encode("utf-8", "surrogatepass")
            h = xxhash.xxh3_64_intdigest(chunk, seed=h)
            names.append(h)
        return names

    def _lookup(self, names: Sequence[int]) -> list[_Segment]:
        """The stored segments of the prompt's leading checkpoints, in order."""
        found: list[_Segment] = []
        end = tokens = 0
        with self._lock:
            segments = self._segments
            for name in names:
                seg = segments.get(name)
                if seg is None or seg.start != end or seg.tokens <= tokens:
                    break
                segments.move_to_end(name)
                found.append(seg)
                end, tokens = seg.end, seg.tokens
        return found

    def _resume(
        self, text: str, found: Sequence[_Segment], special: bool
    ) -> tuple[_Run | _Stitched, list[int], int] | None:
        """Encode ``text`` from just before the last found cut (a long rest in pieces); None
        when the check fails."""
        last = found[-1]
        shift, overlap = last.tail_starts[0], len(last.tail_ids)
        run: _Run | _Stitched | None = self._encode_in_pieces(
            text, False, start=shift, base=last.tokens - overlap)
        if run is None:
            enc = self._encode(text[shift:], False)
            run = _Run(enc, enc.ids, last.tokens - overlap, shift, 0)
        ids = run.ids
        if (len(ids) <= overlap or ids[:overlap] != last.tail_ids.tolist()
                or run.start(last.tokens) != last.end
                or any(run.start(last.tokens - overlap + j) != s
                       for j, s in enumerate(last.tail_starts))):
            return None
        rest = ids[overlap:]
        if special and self._affixes is not None:
            rest = rest + list(self._affixes[1])
        keys: list[int] = []
        for seg in found:
            keys.extend(seg.keys)
        keys.extend(token_block_keys(rest, self._block, keys[-1]))
        return run, keys, last.tokens + len(rest)

    # -- storing -------------------------------------------------------------------------------
    def _store(self, names: Sequence[int], found: Sequence[_Segment], run: _Run | _Stitched,
               keys: Sequence[int]) -> None:
        """Segments for the checkpoints past ``found``, cut from ``run``."""
        opts, block, overlap = self.opts, self._block, self.opts.overlap
        prev_end, prev_tokens = (found[-1].end, found[-1].tokens) if found else (0, 0)
        floor = max(run.base, run.leading) + 1  # the tail's first token, at the least
        lowest = max(prev_tokens + 1, floor + overlap)
        new: list[tuple[int, _Segment]] = []
        for k in range(len(found), len(names)):
            limit = (k + 1) * opts.stride - opts.margin
            g = run.last_at_or_before(limit)
            g -= g % block
            while g >= lowest and run.start(g) < run.end(g - 1):  # inside one character
                g -= block
            if g < lowest:
                break  # no cut here: the chain of segments stops
            # The tail starts a character too: encoding resumes there.
            first = g - overlap
            while first > floor and run.start(first) < run.end(first - 1):
                first -= 1
            if run.start(first) < run.end(first - 1):
                break
            start = run.start(g)
            seg = _Segment(
                start=prev_end, end=start, tokens=g,
                keys=array("Q", keys[prev_tokens // block : g // block]),
                tail_ids=array("q", run.ids[first - run.base : g - run.base]),
                tail_starts=array("q", [run.start(i) for i in range(first, g)]),
            )
            new.append((names[k], seg))
            prev_end, prev_tokens = start, g
            lowest = g + 1
        if not new:
            return
        with self._lock:
            segments = self._segments
            for name, seg in new:
                segments[name] = seg
                segments.move_to_end(name)
            self.stats.stored += len(new)
            while len(segments) > opts.max_segments:
                segments.popitem(last=False)
                self.stats.evicted += 1


def _special_affixes(encode: Encode) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The tokens the tokenizer's special tokens add before and after a text, or None when
    they are not simply that."""
    probe = "Ab 12, cd."
    plain, full = encode(probe, False).ids, encode(probe, True).ids
    n = len(plain)
    for i in range(len(full) - n + 1):
        if full[i : i + n] == plain:
            return tuple(full[:i]), tuple(full[i + n :])
    return None
