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
* **Fine checkpoints** sit every ``fine`` characters in the last ``fine_span`` characters of
  each stored prompt, each named by a hash chained from the checkpoint before its stride
  in a domain of its own. A prompt that shares a stored one's text up to somewhere in those
  strides (a new question after a shared system prompt, a chat's next turn) resumes from the
  deepest fine checkpoint it shares instead of the stride's start: on average it encodes
  again half a fine step and the margin (about 190 characters) instead of half a stride and
  the margin (about 580).
* **A segment** ends at a *cut*: the last token boundary at least ``margin`` characters before
  its checkpoint with a whole number of KV blocks of tokens before it (a fine one starts at
  the cut of the checkpoint before its stride). It keeps the chain keys
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
  the tokenizer runs in parallel, and joined where neighbours agree
  (:mod:`gateway.kvevents.token_runs`); if they never agree it is encoded in one piece.
* Bounded: at most ``max_segments`` segments, the least recently used dropped first.

Only token ids and hashes are kept, never text. The event loop and the tokenizer pool's threads
share the store; a lock guards its table, never an encode.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers
import xxhash

from gateway.contracts.kv_keys import token_block_keys
from gateway.kvevents.token_runs import EncodeMany, Stitched, TokenRun, encode_in_pieces

# encode(text, add_special_tokens) -> its Encoding
Encode = Callable[[str, bool], tokenizers.Encoding]

_TRIES = 3  # cuts tried, from the deepest back, before a prompt is encoded whole


@dataclass(frozen=True, slots=True)
class PrefixStoreOptions:
    stride: int = 1024  # characters between checkpoints
    margin: int = 64  # characters a cut keeps before its checkpoint
    # Fine checkpoints every this many characters in the last ``fine_span`` characters of each
    # stored prompt (0: none), where the next prompt that shares its text most likely goes
    # another way (a question after a shared system prompt, the next turn of a chat).
    fine: int = 256
    fine_span: int = 1024
    overlap: int = 8  # tokens encoded again before a cut, to check it
    max_segments: int = 65_536  # 0: off; 64 MB of prompt text in about 50 MB
    # A text to encode of at least twice this many characters (nothing reused, or the new
    # rest after a cut) is encoded in pieces of this size, in parallel (0: never).
    chunk_chars: int = 32_768

    def __post_init__(self) -> None:
        if self.stride < 1 or self.overlap < 1 or self.max_segments < 0:
            raise ValueError("stride and overlap must be >= 1, max_segments >= 0")
        if not 0 <= self.margin < self.stride:
            raise ValueError("margin must be >= 0 and below stride")
        if self.fine and not (self.margin < self.fine < self.stride
                              and self.stride % self.fine == 0 and self.fine_span >= self.fine):
            raise ValueError("fine must be 0 or above margin, below stride and divide it, "
                             "and fine_span at least fine")
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


class TokenPrefixStore:
    def __init__(self, encode: Encode, block_size: int,
                 opts: PrefixStoreOptions = PrefixStoreOptions(),
                 encode_many: EncodeMany | None = None) -> None:
        """``encode`` one text; ``encode_many`` several in parallel (None: long texts are
        encoded in one piece too)."""
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
        start = _chain_start(special, seed)
        names = self._names(text, start) if usable else []
        found = self._lookup(names) if names else []
        coarse = len(found)  # found[coarse:] is a fine segment past them
        if usable and self.opts.fine:
            past = self._lookup_fine(text, names, found, start)
            if past is not None:
                found = [*found, past]
        self.stats.lookups += 1
        for _ in range(_TRIES):
            if not found:
                break
            resumed = self._resume(text, found, special)
            if resumed is not None:
                run, keys, tokens = resumed
                self.stats.reused += 1
                self.stats.reused_tokens += found[-1].tokens
                self._store(text, names, found[:coarse], run, keys, start)
                return Encoded(keys, tokens, ())
            self.stats.mismatches += 1
            found = found[:-1]  # the cut before
            coarse = min(coarse, len(found))
        run = self._encode_from(text, 0, 0, special)
        keys = token_block_keys(run.ids, self._block, seed)
        if usable:
            self._store(text, names, [], run, keys, start)
        return Encoded(keys, len(run.ids), () if keys else tuple(run.ids))

    def _encode_from(self, text: str, start: int, base: int,
                     special: bool) -> TokenRun | Stitched:
        """``text[start:]``, its tokens numbered from ``base``, with the tokenizer's special
        tokens (``start`` 0 only): in pieces when it is long, else in one."""
        pre, post = self._affixes if special and self._affixes else ((), ())
        many, size = self._encode_many, self.opts.chunk_chars
        if (many is not None and size and len(text) - start >= 2 * size
                and not (special and (self._affixes is None or start))):
            stitched = encode_in_pieces(
                text, many, start=start, base=base, size=size, margin=self.opts.margin,
                overlap=self.opts.overlap, pre=pre, post=post)
            if stitched is not None:
                self.stats.pieced += 1
                return stitched
            self.stats.mismatches += 1  # neighbours that never agreed
        enc = self._encode(text[start:] if start else text, special)
        return TokenRun(enc, enc.ids, base, start, len(pre))

    # -- lookup --------------------------------------------------------------------------------
    def _names(self, text: str, start: int) -> list[int]:
        """Hashes naming the text before each checkpoint, chained from ``start``."""
        stride = self.opts.stride
        h = start
        names = []
        for k in range(len(text) // stride):
            chunk = text[k * stride : (k + 1) * stride].encode("utf-8", "surrogatepass")
            h = xxhash.xxh3_64_intdigest(chunk, seed=h)
            names.append(h)
        return names

    def _fine_names(self, text: str, n: int, names: Sequence[int],
                    start: int) -> list[tuple[int, int]]:
        """(character offset, name) of the fine checkpoints inside stride ``n`` that ``text``
        reaches: each names the text before it, chained from the checkpoint before the
        stride in a domain of their own (a fine name is never a checkpoint's)."""
        stride, fine = self.opts.stride, self.opts.fine
        at = n * stride
        h = xxhash.xxh3_64_intdigest(b"fine", seed=names[n - 1] if n else start)
        out = []
        for j in range(1, stride // fine):
            end = at + j * fine
            if end > len(text):
                break
            chunk = text[end - fine : end].encode("utf-8", "surrogatepass")
            h = xxhash.xxh3_64_intdigest(chunk, seed=h)
            out.append((end, h))
        return out

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

    def _lookup_fine(self, text: str, names: Sequence[int], found: Sequence[_Segment],
                     start: int) -> _Segment | None:
        """The deepest stored fine segment inside the stride after the checkpoints ``found``
        covers, that goes on from their last cut; None if there is none."""
        n = len(found)
        end, tokens = (found[-1].end, found[-1].tokens) if found else (0, 0)
        fine = self._fine_names(text, n, names, start)
        with self._lock:
            segments = self._segments
            for _, name in reversed(fine):
                seg = segments.get(name)
                if seg is not None and seg.start == end and seg.tokens > tokens:
                    segments.move_to_end(name)
                    return seg
        return None

    def _resume(
        self, text: str, found: Sequence[_Segment], special: bool
    ) -> tuple[TokenRun | Stitched, list[int], int] | None:
        """Encode ``text`` from just before the last found cut; None when the check fails."""
        last = found[-1]
        shift, overlap = last.tail_starts[0], len(last.tail_ids)
        run = self._encode_from(text, shift, last.tokens - overlap, False)
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
    def _store(self, text: str, names: Sequence[int], found: Sequence[_Segment],
               run: TokenRun | Stitched, keys: Sequence[int], start: int) -> None:
        """Segments for the checkpoints past ``found``, and for the fine checkpoints in the
        prompt's last ``fine_span`` characters, cut from ``run``."""
        opts = self.opts
        prev_end, prev_tokens = (found[-1].end, found[-1].tokens) if found else (0, 0)
        floor = max(run.base, run.leading) + 1  # the tail's first token, at the least
        new: list[tuple[int, _Segment]] = []
        # Where each stride begins: the cut of the checkpoint before it (0 for the first).
        begins = {len(found): (prev_end, prev_tokens)}
        for k in range(len(found), len(names)):
            seg = self._segment(run, keys, (k + 1) * opts.stride - opts.margin,
                                prev_end, prev_tokens, floor)
            if seg is None:
                break  # no cut here: the chain of segments stops
            new.append((names[k], seg))
            prev_end, prev_tokens = seg.end, seg.tokens
            begins[k + 1] = (prev_end, prev_tokens)
        if opts.fine:
            after = len(text) - opts.fine_span  # fine checkpoints past this
            for n in range(max(0, after // opts.stride), len(text) // opts.stride + 1):
                if n not in begins:
                    continue  # no cut before that stride here (or one found, not encoded)
                begin_end, begin_tokens = begins[n]
                for at, name in self._fine_names(text, n, names, start):
                    if at <= after or name in self._segments:  # (the same text: the same cut)
                        continue
                    seg = self._segment(run, keys, at - opts.margin, begin_end, begin_tokens,
                                        floor)
                    if seg is not None:
                        new.append((name, seg))
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

    def _segment(self, run: TokenRun | Stitched, keys: Sequence[int], limit: int,
                 prev_end: int, prev_tokens: int, floor: int) -> _Segment | None:
        """The segment from the cut ``prev_end`` (``prev_tokens`` before it) to the last
        whole block of tokens ending before character ``limit``; None where there is no such
        cut inside ``run`` (its tail of ``overlap`` tokens included)."""
        block, overlap = self._block, self.opts.overlap
        lowest = max(prev_tokens + 1, floor + overlap)
        g = run.last_at_or_before(limit)
        g -= g % block
        while g >= lowest and run.start(g) < run.end(g - 1):  # inside one character
            g -= block
        if g < lowest:
            return None
        # The tail starts a character too: encoding resumes there.
        first = g - overlap
        while first > floor and run.start(first) < run.end(first - 1):
            first -= 1
        if run.start(first) < run.end(first - 1):
            return None
        return _Segment(
            start=prev_end, end=run.start(g), tokens=g,
            keys=array("Q", keys[prev_tokens // block : g // block]),
            tail_ids=array("q", run.ids[first - run.base : g - run.base]),
            tail_starts=array("q", [run.start(i) for i in range(first, g)]),
        )


def _chain_start(special: bool, seed: int) -> int:
    """Where a prompt's chain of checkpoint names starts: the namespace's seed, and whether
    the tokenizer's special tokens were added."""
    return xxhash.xxh3_64_intdigest(b"special" if special else b"plain", seed=seed)


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
