"""The worker's chat template; it lives in :mod:`gateway.contracts.chat`, where the gateway
renders prompts the same way to tokenize them exactly as the worker does."""

from gateway.contracts.chat import (
    END,
    GENERATION_PROMPT,
    ROLES,
    SYSTEM_ROLES,
    ChatFormatError,
    canonical_json,
    render_chat,
    render_message,
    render_system_prefix,
)

__all__ = [
    "END",
    "GENERATION_PROMPT",
    "ROLES",
    "SYSTEM_ROLES",
    "ChatFormatError",
    "canonical_json",
    "render_chat",
    "render_message",
    "render_system_prefix",
]
