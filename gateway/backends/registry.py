"""Every backend kind the gateway speaks, keyed by the scheme of a worker URL.

Adding a kind is one module that implements :class:`~gateway.backends.base.Backend` and
declares a :class:`~gateway.backends.kinds.BackendKind`, plus its line in ``KINDS``.
"""

from __future__ import annotations

from gateway.backends.base import Backend
from gateway.backends.kinds import BackendKind, BackendOptions
from gateway.backends.openai_http import OPENAI, VLLM
from gateway.backends.sagemaker import SAGEMAKER

KINDS: tuple[BackendKind, ...] = (
    OPENAI,
    VLLM,
    SAGEMAKER,
)
# A URL of no known scheme is read as OpenAI HTTP, whose id check then names what is wrong.
DEFAULT = OPENAI

_BY_SCHEME = {scheme: kind for kind in KINDS for scheme in kind.schemes}
_BY_NAME = {kind.name: kind for kind in KINDS}


def kind_of_url(url: str) -> BackendKind:
    """The kind that serves ``url``, by its scheme."""
    scheme, sep, _ = url.partition("://")
    return _BY_SCHEME.get(scheme, DEFAULT) if sep else DEFAULT


def kind_named(name: str) -> BackendKind | None:
    return _BY_NAME.get(name)


def build_backends(options: BackendOptions) -> dict[str, Backend]:
    """One backend per kind, by kind name."""
    return {kind.name: kind.build(options) for kind in KINDS}
