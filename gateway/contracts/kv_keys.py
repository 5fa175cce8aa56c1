"""Block keys of token ids: what a request's prompt and an engine's cached block agree on.

Engines hash their blocks with their own algorithm and seed (vLLM: sha256 or xxhash, seeded by
``PYTHONHASHSEED`` or at random), so the gateway never compares engine hashes with its own.
Events carry each stored block's token ids, and the gateway keys a block by its own chain::

    k0 = xxh3_64(token_ids(block 0), seed=chain_seed(lora_name, salt))
    ki = xxh3_64(token_ids(block i), seed=k(i-1))

over the token ids as little-endian signed 64-bit integers, so ``ki`` identifies the whole
prefix up to block ``i``, exactly as the engine's own chained hash does. The seed mixes in what
the engine mixes into a first block besides its tokens: the LoRA adapter and the cache
namespace (vLLM's ``cache_salt``; the reference worker's tenant namespace), which an event
carries in the first block's ``extra_keys``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

_SEP = "\x1f"
_VERSION = "token-blocks-v1"


def engine_namespace(tenant: str, cache_salt: str) -> str:
    """The cache namespace an engine puts a request in: the tenant (which the gateway sends as
    ``x-cache-namespace``) and the request's ``cache_salt``, joined when both are set."""
    if tenant and cache_salt:
        return f"{tenant}{_SEP}{cache_salt}"
    return tenant or cache_salt


def chain_seed(lora_name: str = "", salt: str = "") -> int:
    raw = _SEP.join((_VERSION, lora_name, salt))
    return xxhash.xxh3_64_intdigest(raw.encode("utf-8", "surrogatepass"))


def salt_of(extra_keys: Sequence[Any] | None, lora_name: str | None) -> str:
    """The namespace among a first block's extra keys: its string keys other than the LoRA
    name, joined (vLLM puts the ``cache_salt`` there; multimodal prompts are not keyed)."""
    if not extra_keys:
        return ""
    return _SEP.join(k for k in extra_keys if isinstance(k, str) and k != lora_name)


def token_block_keys(
    tokens: Sequence[int], block_size: int, seed: int, max_blocks: int | None = None
) -> list[int]:
    """Chained keys of the full blocks of ``tokens`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    raw = array("q", tokens[: full * block_size]).tobytes()
    step = 8 * block_size
    keys: list[int] = []
    h = seed
    hash_fn = xxhash.xxh3_64_intdigest
    for i in range(full):
        h = hash_fn(raw[i * step : (i + 1) * step], seed=h)
        keys.append(h)
    return keys


def chain_from(parent_key: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """Keys of the full blocks of ``tokens`` continuing the chain after ``parent_key``."""
    return token_block_keys(tokens, block_size, parent_key)
