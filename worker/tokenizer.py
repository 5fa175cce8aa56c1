"""Tokenizers for the worker.

The default :class:`HashTokenizer` is a documented, deterministic stand-in for a BPE tokenizer:

1. pre-tokenize with the GPT-2 regex
   (``'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\\sA-Za-z0-9]+|\\s+(?!\\S)|\\s+``);
2. split every piece longer than 4 characters into 4-character chunks;
3. token id = ``xxhash.xxh32_intdigest(chunk) % 50257``.

Why: it yields roughly one token per 3-4 characters of English text (3.1 on typical prose, where
GPT-2/Llama BPE give about 4-4.5), so token counts, block counts and simulated costs are of the
right size; it is deterministic across processes and
machines (no ``PYTHONHASHSEED`` dependence), so any gateway or simulator can reproduce the
worker's block hashes; and it needs no download. Because the regex has no look-behind, text split
where a non-whitespace character is followed by whitespace tokenizes piecewise:
``encode(a + b) == encode(a) + encode(b)`` when ``a`` ends with a non-whitespace character and
``b`` starts with whitespace.

:class:`CharsTokenizer` is the plainest stand-in: one token per 4 characters (the gateway's
``chars_per_token`` estimate), so token counts equal the gateway's and text cut at multiples of
``4 x block_size`` characters is cut at KV block boundaries. Replays use it to make one block
of synthesized text exactly one cache block.

:class:`HFTokenizer` wraps a local HuggingFace ``tokenizers`` JSON file when that optional
package is installed.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Protocol

import xxhash

GPT2_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
)
DEFAULT_VOCAB_SIZE = 50257
CHUNK_CHARS = 4


class Tokenizer(Protocol):
    """Turns text into token ids."""

    @property
    def name(self) -> str: ...

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids; ``special``: add the tokenizer's special tokens (BOS) where it has any."""
        ...


class TokenizerUnavailableError(RuntimeError):
    """The configured tokenizer cannot be loaded."""


class HashTokenizer:
    """Deterministic GPT-2-regex + 4-character-chunk + xxh32 tokenizer (see module docstring)."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        self.vocab_size = vocab_size

    @property
    def name(self) -> str:
        return f"hash-gpt2-4c-{self.vocab_size}"

    def pieces(self, text: str) -> list[str]:
        """The chunks that become tokens, in order."""
        out: list[str] = []
        for piece in GPT2_PATTERN.findall(text):
            if len(piece) <= CHUNK_CHARS:
                out.append(piece)
            else:
                out.extend(piece[i : i + CHUNK_CHARS] for i in range(0, len(piece), CHUNK_CHARS))
        return out

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        vocab = self.vocab_size  # no special tokens: ``special`` adds nothing
        # surrogatepass: JSON can carry lone surrogates ("\\ud800"); they must not crash encoding.
        return [
            xxhash.xxh32_intdigest(p.encode("utf-8", "surrogatepass")) % vocab
            for p in self.pieces(text)
        ]


class CharsTokenizer(HashTokenizer):
    """One token per :data:`CHUNK_CHARS` characters: ``xxh32(chunk) % vocab_size``."""

    @property
    def name(self) -> str:
        return f"chars-{CHUNK_CHARS}-{self.vocab_size}"

    def pieces(self, text: str) -> list[str]:
        return [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]


class HFTokenizer:
    """A HuggingFace ``tokenizers`` JSON file (optional dependency, loaded from a local path)."""

    def __init__(self, path: str) -> None:
        try:
            module: Any = importlib.import_module("tokenizers")
        except ImportError as exc:
            raise TokenizerUnavailableError(
                f"tokenizer_file={path!r} needs the 'tokenizers' package "
                "(pip install tokenizers), or leave it empty for the built-in hash tokenizer"
            ) from exc
        try:
            self._tok: Any = module.Tokenizer.from_file(path)
        except Exception as exc:  # the library raises its own exception types
            raise TokenizerUnavailableError(f"cannot load tokenizer {path!r}: {exc}") from exc
        self._path = path

    @property
    def name(self) -> str:
        return f"hf:{self._path}"

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        try:
            ids: list[int] = list(self._tok.encode(text, add_special_tokens=special).ids)
        except Exception as exc:  # the library raises its own exception types
            raise ValueError(f"cannot tokenize: {exc}") from exc
        return ids

    def decode_one(self, token_id: int) -> str:
        """The text of one token id (empty for an id the vocabulary lacks)."""
        try:
            text: str = self._tok.decode([token_id], skip_special_tokens=False)
        except Exception:  # the library raises its own exception types
            return ""
        return text

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` together (a character split over two tokens whole; empty
        for ids the vocabulary lacks)."""
        try:
            text: str = self._tok.decode(token_ids, skip_special_tokens=False)
        except Exception:  # the library raises its own exception types
            return ""
        return text


def load_tokenizer(tokenizer_file: str, builtin: str = "hash") -> Tokenizer:
    """The HF tokenizer at ``tokenizer_file``; when it is empty, the built-in one named
    ``builtin`` (``hash`` or ``chars``)."""
    if tokenizer_file:
        return HFTokenizer(tokenizer_file)
    if builtin == "chars":
        return CharsTokenizer()
    return HashTokenizer()
