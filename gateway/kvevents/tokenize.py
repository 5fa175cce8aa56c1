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

Encoding runs in a small thread pool (the Rust tokenizer does the work, the loop keeps
serving); :attr:`PromptTokenizer.stats` keeps its count and cost.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import tokenizers
import xxhash

from gateway.contracts.chat import ChatFormatError
from gateway.contracts.chat_template import ChatTemplateError, load_chat_template
from gateway.contracts.kv_keys import chain_seed, token_block_keys
from gateway.fingerprint import PrefixKey


class TokenizerError(ValueError):
    """The tokenizer file cannot be loaded."""


@dataclass(frozen=True, slots=True)
class TokenizerOptions:
    path: str
    block_size: int = 16  # tokens per engine KV block
    max_blocks: int = 4096  # keys per prompt (64k tokens at 16 per block)
    anchor_blocks: int = 4
    threads: int = 2
    chat_template: str = "reference"  # or a tokenizer_config.json / Jinja file path

    def __post_init__(self) -> None:
        if min(self.block_size, self.max_blocks, self.anchor_blocks, self.threads) < 1:
            raise ValueError("block_size, max_blocks, anchor_blocks and threads must be >= 1")


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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def key(
        self, body: Mapping[str, Any], *, chat: bool, salt: str
    ) -> TokenizedPrompt | None:
        """The request's token-exact key within cache namespace ``salt``, or None when it
        cannot be tokenized here (it is then keyed by characters)."""
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
        try:
            ids = self._ids(body, chat)
            out = self.keyed(ids, salt) if ids is not None else None
        except (ChatFormatError, ValueError, TypeError, OverflowError):
            out = None
        except Exception:  # the tokenizer library raises its own exception types
            out = None
        return out, time.perf_counter() - started

    def _ids(self, body: Mapping[str, Any], chat: bool) -> list[int] | None:
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
            return self.encode(text, special=body.get("add_special_tokens") is True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt, special=body.get("add_special_tokens") is not False)
        if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            return list(prompt)
        return None

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``special``, the tokenizer's post-processor adds its
        special tokens (BOS)."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=special).ids
        return ids

    def keyed(self, ids: list[int], salt: str) -> TokenizedPrompt:
        opts = self.opts
        seed = chain_seed("", salt)
        blocks = token_block_keys(ids, opts.block_size, seed, opts.max_blocks)
        if blocks:
            anchor = blocks[min(opts.anchor_blocks, len(blocks)) - 1]
        else:  # shorter than one block: nothing cacheable, but it needs a ring anchor
            anchor = xxhash.xxh3_64_intdigest(array("q", ids).tobytes(), seed=seed)
        key = PrefixKey(blocks=tuple(blocks), anchor=anchor, text_chars=len(ids))
        return TokenizedPrompt(key=key, tokens=len(ids), block_size=opts.block_size)
