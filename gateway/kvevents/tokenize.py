"""Token-exact prompt keys: the served model's tokenizer, run off the event loop.

With a tokenizer configured (``--tokenizer-file``, a local HuggingFace ``tokenizer.json``; never
downloaded), the gateway turns a request into the token ids its engine will see and keys it by
the same chained hash of token blocks that events are keyed by (:mod:`gateway.contracts.kv_keys`):

* chat requests are rendered with the model's chat template first (``reference``: the
  reference worker's template; or the model's Jinja template from its ``tokenizer_config.json``,
  :mod:`gateway.contracts.chat_template`), honouring the request's ``add_generation_prompt``,
  ``continue_final_message`` and ``chat_template_kwargs``, then encoded without added special
  tokens unless the request asks for them (vLLM's defaults: the template writes BOS itself);
* a completion ``prompt`` that is one string is encoded with the tokenizer's special tokens
  (BOS, from its post-processor) unless ``add_special_tokens`` is false, as vLLM encodes it;
  one that is token ids is used as is;
* anything else (several prompts, content the template rejects, text the tokenizer fails on)
  returns None, and the request is keyed by the character fingerprint instead.

Encoding runs in a small thread pool (the Rust tokenizer does the work without the GIL, the
loop keeps serving), but for prompts of at most ``inline_chars`` characters (4,096), which cost
less to encode on the loop than the hop to a thread and back; :attr:`PromptTokenizer.stats`
keeps the count and cost. A prompt that extends one tokenized before (the next turn of a
session, a question over a known document) is encoded only past the text it shares
(:mod:`gateway.kvevents.token_prefix`).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import tokenizers
import xxhash

from gateway.contracts.chat import ChatFormatError
from gateway.contracts.chat_template import ChatTemplateError, load_chat_template
from gateway.contracts.kv_keys import chain_seed, token_block_keys
from gateway.fingerprint import PrefixKey
from gateway.kvevents.token_prefix import PrefixStoreOptions, TokenPrefixStore


def _prompt_chars(body: Mapping[str, Any], chat: bool) -> int:
    """The characters of a request's prompt, its messages' text (more when it has parts
    that are not plain text); quick, for deciding where to tokenize it."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 1 << 30
        n = 0
        for m in messages:
            c = m.get("content") if isinstance(m, dict) else None
            n += len(c) if isinstance(c, str) else 1 << 20
        return n
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 1 << 30


def _has_parts_not_text(messages: Any) -> bool:
    """Whether a chat's messages carry a content part that is not text (an image)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not (isinstance(p, dict) and p.get("type") == "text") for p in m["content"])
        for m in messages)


class TokenizerError(ValueError):
    """The tokenizer file cannot be loaded."""


@dataclass(frozen=True, slots=True)
class TokenizerOptions:
    path: str
    block_size: int = 16  # tokens per engine KV block
    max_blocks: int = 16_384  # keys per prompt (256k tokens at 16 per block)
    anchor_blocks: int = 4
    threads: int = 2
    chat_template: str = "reference"  # or a tokenizer_config.json / Jinja file path
    inline_chars: int = 4096  # prompts of at most this many characters are keyed on the loop
    # max_segments=0: every prompt encoded whole
    prefix_store: PrefixStoreOptions = field(default_factory=PrefixStoreOptions)

    def __post_init__(self) -> None:
        if min(self.block_size, self.max_blocks, self.anchor_blocks, self.threads) < 1:
            raise ValueError("block_size, max_blocks, anchor_blocks and threads must be >= 1")
        if self.inline_chars < 0:
            raise ValueError("inline_chars must be >= 0")


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    key: PrefixKey  # blocks = token-block keys
    tokens: int  # prompt length in tokens
    block_size: int


@dataclass(slots=True)
class TokenizeStats:
    prompts: int = 0
    fallbacks: int = 0
    tokens: int = 0
    seconds: float = 0.0  # summed time in the pool (encode + keys)


class PromptTokenizer:
    def __init__(
        self, opts: TokenizerOptions, observe: Callable[[float], None] | None = None
    ) -> None:
        try:
            self._tok = tokenizers.Tokenizer.from_file(opts.path)
        except Exception as exc:  # the library raises its own exception types
            raise TokenizerError(f"cannot load tokenizer {opts.path!r}: {exc}") from exc
        try:
            self._template = load_chat_template(opts.chat_template)
        except ChatTemplateError as exc:
            raise TokenizerError(str(exc)) from exc
        self.opts = opts
        self.stats = TokenizeStats()
        self._observe = observe
        self._pool = ThreadPoolExecutor(opts.threads, thread_name_prefix="tokenize")
        self.prefixes = TokenPrefixStore(self._encoding, opts.block_size, opts.prefix_store,
                                         encode_many=self._encodings)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def key(
        self, body: Mapping[str, Any], *, chat: bool, salt: str
    ) -> TokenizedPrompt | None:
        """The request's token-exact key within cache namespace ``salt``, or None when it
        cannot be tokenized here (it is then keyed by characters)."""
        if _prompt_chars(body, chat) <= self.opts.inline_chars:
            out, seconds = self._key(body, chat, salt)
        else:
            loop = asyncio.get_running_loop()
            out, seconds = await loop.run_in_executor(self._pool, self._key, body, chat, salt)
        self.stats.prompts += 1
        self.stats.seconds += seconds
        if self._observe is not None:
            self._observe(seconds)
        if out is None:
            self.stats.fallbacks += 1
        else:
            self.stats.tokens += out.tokens
        return out

    def _key(
        self, body: Mapping[str, Any], chat: bool, salt: str
    ) -> tuple[TokenizedPrompt | None, float]:
        started = time.perf_counter()
        out = self.key_here(body, chat=chat, salt=salt)
        return out, time.perf_counter() - started

    def key_here(
        self, body: Mapping[str, Any], *, chat: bool, salt: str
    ) -> TokenizedPrompt | None:
        """:meth:`key` in the calling thread, uncounted (the simulator keys a replay's
        requests as the gateway does)."""
        try:
            return self._keyed_body(body, chat, chain_seed("", salt))
        except (ChatFormatError, ValueError, TypeError, OverflowError):
            return None
        except Exception:  # the tokenizer library raises its own exception types
            return None

    def _keyed_body(
        self, body: Mapping[str, Any], chat: bool, seed: int
    ) -> TokenizedPrompt | None:
        prompt = self._engine_prompt(body, chat)
        if isinstance(prompt, tuple):
            return self._keyed_text(*prompt, seed)
        return None if prompt is None else self._keyed_ids(prompt, seed)

    def _engine_prompt(
        self, body: Mapping[str, Any], chat: bool
    ) -> tuple[str, bool] | list[int] | None:
        """What the engine encodes for ``body``: its text and whether the tokenizer's special
        tokens are added, or the token ids it was given (None: neither, module docstring)."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            tools = body.get("tools")
            kwargs = body.get("chat_template_kwargs")
            text = self._template.render(
                messages, tools if isinstance(tools, list) else None,
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                continue_final_message=body.get("continue_final_message") is True,
                extra=kwargs if isinstance(kwargs, Mapping) else None,
            )
            return text, body.get("add_special_tokens") is True
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt, body.get("add_special_tokens") is not False
        if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            return list(prompt)
        return None

    async def leading_ids(
        self, body: Mapping[str, Any], *, chat: bool, tokens: int
    ) -> list[int] | None:
        """The first ``tokens`` token ids the engine runs for ``body`` (encoded whole, off the
        event loop), or None where there are fewer, where the request cannot be tokenized
        here, or where a message has content that is not text (an image's tokens are not
        its ids alone). The pre-warmer copies a held prefix with them."""
        if chat and _has_parts_not_text(body.get("messages")):
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._leading_ids, body, chat, tokens)

    def _leading_ids(
        self, body: Mapping[str, Any], chat: bool, tokens: int
    ) -> list[int] | None:
        try:
            prompt = self._engine_prompt(body, chat)
            if isinstance(prompt, tuple):
                prompt = list(self._encoding(*prompt).ids)
        except Exception:  # the template's ChatFormatError, the tokenizer library's own types
            return None
        return None if prompt is None or len(prompt) < tokens else prompt[:tokens]

    def _keyed_text(self, text: str, special: bool, seed: int) -> TokenizedPrompt:
        enc = self.prefixes.encode(text, special=special, seed=seed)
        return self._prompt_key(enc.keys[: self.opts.max_blocks], enc.tokens, enc.short_ids,
                                seed)

    def _encoding(self, text: str, special: bool) -> tokenizers.Encoding:
        return self._encodings([text], special)[0]

    def _encodings(self, texts: list[str], special: bool) -> list[tokenizers.Encoding]:
        # encode_batch lets go of the GIL while it encodes (encode does not): the event loop
        # keeps serving meanwhile; and it encodes several texts in parallel.
        encs: list[tokenizers.Encoding] = self._tok.encode_batch(texts, add_special_tokens=special)
        return encs

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``special``, the tokenizer's post-processor adds its
        special tokens (BOS)."""
        ids: list[int] = self._encoding(text, special).ids
        return ids

    def keyed(self, ids: list[int], salt: str) -> TokenizedPrompt:
        return self._keyed_ids(ids, chain_seed("", salt))

    def _keyed_ids(self, ids: list[int], seed: int) -> TokenizedPrompt:
        keys = token_block_keys(ids, self.opts.block_size, seed, self.opts.max_blocks)
        return self._prompt_key(keys, len(ids), () if keys else tuple(ids), seed)

    def _prompt_key(self, blocks: list[int], tokens: int, short_ids: tuple[int, ...],
                    seed: int) -> TokenizedPrompt:
        opts = self.opts
        if blocks:
            anchor = blocks[min(opts.anchor_blocks, len(blocks)) - 1]
        else:  # shorter than one block: nothing cacheable, but it needs a ring anchor
            anchor = xxhash.xxh3_64_intdigest(array("q", short_ids).tobytes(), seed=seed)
        key = PrefixKey(blocks=tuple(blocks), anchor=anchor, text_chars=tokens)
        return TokenizedPrompt(key=key, tokens=tokens, block_size=opts.block_size)
