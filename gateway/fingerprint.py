"""Prefix fingerprints: chained block hashes over the canonical prompt text.

The canonical text (see :mod:`gateway.normalize`) is cut into fixed-size blocks of
``block_chars`` characters and hashed as a chain::

    h0 = xxh3_64(block0, seed=namespace_seed)
    hi = xxh3_64(block_i, seed=h(i-1))

so ``hi`` identifies the *whole* prefix up to block ``i``, and two prompts share ``hi`` exactly
when they share their first ``i + 1`` blocks. Matching a prompt against an index of such hashes
therefore finds the longest shared prefix by walking the chain from the start.

Why these choices:

* **Characters, not tokens**, by default: the gateway has no tokenizer, and a character block is
  stable under any tokenizer as long as the text is normalized. 64 characters is about 16 tokens
  at ~4 characters per token, the default KV block size of vLLM, so one fingerprint block is
  about one KV block on the worker.
* **xxh3_64** is among the fastest good 64-bit hashes (GB/s in C), so fingerprinting 16 KiB of
  prompt costs microseconds; the chain needs no cryptographic strength, only few collisions.
* **Namespace seed**: the chain starts from a hash of (tenant, model, adapter, cache_salt). Two
  tenants with the same system prompt get different fingerprints, as their KV blocks differ
  (vLLM salts the first block with ``cache_salt``); the same prompt for two models or adapters
  never shares a cache entry either.
* **Full blocks only**: a partial trailing block is not hashed (the worker does not cache it
  either), except when the prompt is shorter than one block, so that every prompt has an anchor.
* **Whole prompts, sparse checkpoints**: up to ``max_blocks`` blocks (16,384 x 64 characters =
  1 MiB, about 256k tokens) are covered. The first ``dense_blocks`` blocks each get a hash;
  beyond them a hash marks a *checkpoint* every ``stride`` blocks, where the stride is the
  largest power of two not above ``depth / checkpoint_ratio`` (so about ``checkpoint_ratio``
  checkpoints per doubling of the depth), and the prompt's last full block is always one. A
  checkpoint's hash chains over the whole segment since the previous one, so it still names the
  whole prefix. Positions depend only on the depth, never on the text, so two prompts that
  share a prefix share every checkpoint inside it. Per request that is ~60 + 32 * log2(n / 64)
  hashes instead of ``n`` (a 200k-token prompt: ~340 instead of 12,500); the bytes are hashed
  once, by xxh3 in C. The cost: a shared prefix is known to the nearest checkpoint (within
  1/32 of its depth).
* **Anchor**: the hash at block ``anchor_blocks`` (or the last block of a shorter prompt).
  Consistent hashing places a cold prefix by its anchor, so prompts that share their first
  ``anchor_blocks`` blocks start from the same ring position.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import xxhash

from gateway.values import value

_FIELD_SEP = "\x1f"


@value
class Namespace:
    """What separates caches: requests in different namespaces never share a prefix."""

    tenant: str = ""
    model: str = ""
    adapter: str = ""
    cache_salt: str = ""

    def seed(self) -> int:
        raw = _FIELD_SEP.join((self.tenant, self.model, self.adapter, self.cache_salt))
        return xxhash.xxh3_64_intdigest(raw.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class FingerprintOptions:
    block_chars: int = 64
    max_blocks: int = 16_384
    anchor_blocks: int = 4
    dense_blocks: int = 64
    checkpoint_ratio: int = 32

    def __post_init__(self) -> None:
        if min(self.block_chars, self.max_blocks, self.anchor_blocks, self.dense_blocks,
               self.checkpoint_ratio) < 1:
            raise ValueError("block_chars, max_blocks, anchor_blocks, dense_blocks and "
                             "checkpoint_ratio must be >= 1")


def checkpoint_depths(blocks: int, opts: FingerprintOptions = FingerprintOptions()) -> list[int]:
    """The depths (in blocks, 1-based) that get a hash in a prompt of ``blocks`` full blocks:
    every block up to ``dense_blocks``, then steps of the largest power of two not above
    ``depth / checkpoint_ratio``, and ``blocks`` itself last."""
    depth = min(blocks, opts.dense_blocks)
    depths = list(range(1, depth + 1))
    ratio = opts.checkpoint_ratio
    while depth < blocks:
        stride = 1 << max(0, (depth // ratio).bit_length() - 1)
        level_end = max(2 * ratio * stride, depth + 1)  # where the stride doubles
        steps = range(depth + stride, min(level_end, blocks) + stride, stride)
        depths.extend(steps)
        depth = steps[-1]
    if depths and depths[-1] > blocks:
        depths[-1] = blocks
    return depths


@value
class PrefixKey:
    """The chained hashes of one prompt at its checkpoints, plus its ring anchor.

    ``blocks[i]`` names the prefix of ``depths[i]`` blocks; ``depths`` empty means every block
    is a checkpoint (``depths[i] == i + 1``), as for keys built from a trace's block ids.
    """

    blocks: tuple[int, ...]
    anchor: int
    text_chars: int
    depths: tuple[int, ...] = ()
    # Blocks in the whole fingerprinted prompt (the depth of its last checkpoint): a plain
    # attribute, read several times per decision.
    total_blocks: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_blocks",
                           self.depths[-1] if self.depths else len(self.blocks))

    @property
    def anchor_hex(self) -> str:
        return f"{self.anchor:016x}"


    def depth_at(self, i: int) -> int:
        """Depth in blocks of checkpoint ``i``."""
        return self.depths[i] if self.depths else i + 1

    def checkpoints_within(self, depth: int) -> int:
        """How many leading checkpoints lie within the first ``depth`` blocks."""
        return bisect.bisect_right(self.depths, depth) if self.depths else depth

    def goes_on_from(self, other: PrefixKey) -> bool:
        """Whether this prompt starts with the whole of ``other``'s, to the deeper of its last
        two checkpoints that this key has too (a prompt's last full block is a checkpoint of
        its own; those before it lie where any prompt of that length has them). O(log n)."""
        for i in range(len(other.blocks) - 1, max(len(other.blocks) - 3, -1), -1):
            depth = other.depth_at(i)
            j = min(self.checkpoints_within(depth), len(self.blocks))
            if j and self.depth_at(j - 1) == depth:
                return self.blocks[j - 1] == other.blocks[i]
        return False

    def cut(self, checkpoints: int, text_chars: int) -> PrefixKey:
        """The key of this prompt's first ``text_chars`` characters, whose last full block is
        checkpoint ``checkpoints - 1`` (at least one): its first ``checkpoints`` hashes, the
        same anchor."""
        depths = self.depths[:checkpoints] if self.depths else ()
        return PrefixKey(self.blocks[:checkpoints], self.anchor, text_chars, depths)

    def anchor_past(self, depth: int) -> int:
        """The ring anchor of the rest of the prompt after its first ``depth`` blocks: the
        deepest checkpoint as far past ``depth`` as :attr:`anchor` is past the start (the
        first checkpoint past it where the checkpoints are sparser; the last one of a shorter
        prompt). Prompts that share a trunk of ``depth`` blocks and go on alike share it."""
        blocks, depths = self.blocks, self.depths
        if not blocks:
            return self.anchor
        try:
            span = self.depth_at(blocks.index(self.anchor, 0, 64))
        except ValueError:  # an anchor of no block (an empty prompt's)
            span = 1
        if not depths:
            return blocks[min(depth + span, len(blocks)) - 1]
        i = bisect.bisect_right(depths, depth + span) - 1
        if i < 0 or depths[i] <= depth:
            i = bisect.bisect_right(depths, depth)
        return blocks[min(i, len(blocks) - 1)]


def fingerprint(
    text: str, namespace: Namespace, opts: FingerprintOptions = FingerprintOptions(),
    prior: PrefixKey | None = None,
) -> PrefixKey:
    """Fingerprint ``text`` (already normalized) within ``namespace``. ``prior``: the key, in
    the same namespace and options, of a text that ``text`` begins with; its checkpoints that
    are also ``text``'s are taken as they are, and only the rest of ``text`` is hashed."""
    size = opts.block_chars
    full = min(len(text) // size, opts.max_blocks)
    seed = namespace.seed()
    hash_fn = xxhash.xxh3_64_intdigest
    if full == 0:
        blocks = [hash_fn(text.encode("utf-8"), seed=seed)] if text else []
        anchor = blocks[0] if blocks else seed
        return PrefixKey(tuple(blocks), anchor, len(text), (1,) if blocks else ())
    all_depths = depths = checkpoint_depths(full, opts)
    blocks = []
    h = seed
    start = 0
    if prior is not None and prior.depths:
        # Checkpoint positions depend only on the depth, the last one (the prompt's end) aside.
        kept = 0
        for old, new in zip(prior.depths[:-1], depths, strict=False):
            if old != new:
                break
            kept += 1
        if kept:
            blocks = list(prior.blocks[:kept])
            h = blocks[-1]
            start = depths[kept - 1] * size
            depths = depths[kept:]
    if text.isascii():  # one character is one byte: slice the encoded text without copying
        end = full * size
        # Encoded whole unless that would encode more than a block past the last full one, or
        # the part a prior key covers: a slice first would copy the prompt once more.
        base = start
        whole = base == 0 and len(text) - end < size
        data = memoryview((text if whole else text[base:end]).encode("ascii"))
        for d in depths:
            end = d * size
            h = hash_fn(data[start - base:end - base], seed=h)
            blocks.append(h)
            start = end
    else:
        for d in depths:
            end = d * size
            h = hash_fn(text[start:end].encode("utf-8"), seed=h)
            blocks.append(h)
            start = end
    # The deepest checkpoint within the first anchor_blocks blocks (the last, if fewer).
    anchor = blocks[max(0, bisect.bisect_right(all_depths, opts.anchor_blocks) - 1)]
    return PrefixKey(tuple(blocks), anchor, len(text), tuple(all_depths))
