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
* **Bounded**: at most ``max_blocks`` blocks are hashed (256 x 64 = 16 KiB by default), which
  bounds the per-request cost; deeper prefixes route like their first 16 KiB.
* **Anchor**: the hash at block ``anchor_blocks - 1`` (or the last block of a shorter prompt).
  Consistent hashing places a cold prefix by its anchor, so prompts that share their first
  ``anchor_blocks`` blocks start from the same ring position.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

_FIELD_SEP = "\x1f"


@dataclass(frozen=True, slots=True)
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
    max_blocks: int = 256
    anchor_blocks: int = 4

    def __post_init__(self) -> None:
        if self.block_chars < 1 or self.max_blocks < 1 or self.anchor_blocks < 1:
            raise ValueError("block_chars, max_blocks and anchor_blocks must be >= 1")


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """The chained block hashes of one prompt, plus its ring anchor."""

    blocks: tuple[int, ...]
    anchor: int
    text_chars: int

    @property
    def anchor_hex(self) -> str:
        return f"{self.anchor:016x}"


def fingerprint(
    text: str, namespace: Namespace, opts: FingerprintOptions = FingerprintOptions()
) -> PrefixKey:
    """Fingerprint ``text`` (already normalized) within ``namespace``."""
    size = opts.block_chars
    full = min(len(text) // size, opts.max_blocks)
    seed = namespace.seed()
    blocks: list[int] = []
    h = seed
    hash_fn = xxhash.xxh3_64_intdigest
    for i in range(full):
        h = hash_fn(text[i * size : (i + 1) * size].encode("utf-8"), seed=h)
        blocks.append(h)
    if not blocks and text:
        blocks.append(hash_fn(text.encode("utf-8"), seed=seed))
    anchor = blocks[min(opts.anchor_blocks, len(blocks)) - 1] if blocks else seed
    return PrefixKey(blocks=tuple(blocks), anchor=anchor, text_chars=len(text))
