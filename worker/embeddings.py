"""The reference worker's embeddings: feature hashing of token sequences, not a learned model.

``POST /v1/embeddings`` answers in OpenAI's shape so that a client, a gateway and their tests
run the whole path (routing, limits, relaying) without a GPU. Its vectors are *hashed bags of
tokens*: every token and every pair of neighbouring tokens adds a signed unit (pairs: half a
unit) to one of ``dimensions`` buckets chosen by its hash, and the vector is scaled to unit
length. Texts that share tokens point the same way, so a cosine similarity means something,
but nothing here was trained: it is a stand-in for a pooling model with the same interface.

``encoding_format: "base64"`` (what the official ``openai`` client asks for by default) is the
vector as little-endian float32, base64-encoded.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence

import xxhash

DEFAULT_DIMENSIONS = 256
MAX_DIMENSIONS = 4096
_TOKEN = struct.Struct("<Q")
_PAIR = struct.Struct("<QQ")
_PAIR_WEIGHT = 0.5


def embed(tokens: Sequence[int], dimensions: int) -> list[float]:
    """The unit vector of ``tokens`` in ``dimensions`` buckets (all zeros when every feature
    cancels out, which needs a collision of opposite signs)."""
    if dimensions < 1:
        raise ValueError("dimensions must be >= 1")
    vec = [0.0] * dimensions
    digest = xxhash.xxh3_64_intdigest
    previous = -1
    for token in tokens:
        h = digest(_TOKEN.pack(token))
        vec[h % dimensions] += 1.0 if h >> 63 else -1.0
        if previous >= 0:
            h = digest(_PAIR.pack(previous, token))
            vec[h % dimensions] += _PAIR_WEIGHT if h >> 63 else -_PAIR_WEIGHT
        previous = token
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm else vec


def as_base64(vec: Sequence[float]) -> str:
    """``vec`` as little-endian float32, base64-encoded (OpenAI's ``encoding_format``)."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
