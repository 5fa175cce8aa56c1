"""The client API besides completions: what an engine's OpenAI-compatible server serves and
the gateway relays (:mod:`gateway.engine_api`).

vLLM's server answers pooling models (embeddings, classification, scores and reranking, raw
pooling) and its tokenizer at these paths; sglang-router and smg relay them as well.
"""

from __future__ import annotations

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# What every backend serves (SageMaker endpoints included), and whose streams report their
# usage only when asked (``stream_options.include_usage``).
COMPLETION_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH})
# Requests a pooling model runs: they may use the engine's prefix cache, so they carry the
# tenant's cache namespace as completions do.
POOLING_PATHS = (
    "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
    "/v2/rerank",
)
# The tokenizer's: nothing is cached.
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
ENGINE_API_PATHS = frozenset(POOLING_PATHS + TOKENIZER_PATHS)


def is_client_api(path: str) -> bool:
    """Whether ``path`` is the client API (``/v1/*`` and :data:`ENGINE_API_PATHS`): a request
    there needs an API key once keys are configured, and routing headers are shown only to
    the callers allowed to see them."""
    return path.startswith("/v1/") or path in ENGINE_API_PATHS
