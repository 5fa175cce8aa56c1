"""Tokenizing requests in the order they arrived, as vLLM's API server does.

vLLM tokenizes every request in one tokenizer thread (a one-worker executor), so requests reach
its scheduler in the order their bodies were read. A gateway that sends turn N of a session
and then turn N+1 relies on that: turn N+1 is predicted to find turn N's blocks cached. A pool
of tokenizer threads breaks it (a longer text that started first can finish last), and so does
encoding a short text inline while a longer one is still in the thread.

:class:`TokenizeLane` keeps the order and keeps the event loop serving: one request's texts
are encoded in one job, in the lane's single thread when they are long or when an earlier
request is still being tokenized there, inline otherwise (the common case of short prompts
on an idle lane costs no thread hop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from worker.tokenizer import Tokenizer

# Requests whose texts total more than this are tokenized in the lane's thread.
THREAD_TOKENIZE_CHARS = 8192


class EncodeError(ValueError):
    """The tokenizer rejected text number ``index`` of a request."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class TokenizeLane:
    """One tokenizer thread; requests come out of :meth:`encode` in the order they went in."""

    def __init__(self, tokenizer: Tokenizer, inline_chars: int = THREAD_TOKENIZE_CHARS) -> None:
        self.tokenizer = tokenizer
        self.inline_chars = inline_chars
        self._executor: ThreadPoolExecutor | None = None
        self._queued = 0  # requests in the thread, or waiting for it

    def _encode_all(self, texts: Sequence[str], special: Sequence[bool]) -> list[list[int]]:
        out: list[list[int]] = []
        for i, (text, add) in enumerate(zip(texts, special, strict=True)):
            try:
                out.append(self.tokenizer.encode(text, special=add))
            except ValueError as exc:
                raise EncodeError(i, str(exc)) from exc
        return out

    async def encode(self, texts: Sequence[str], special: Sequence[bool]) -> list[list[int]]:
        """The token ids of each of one request's ``texts`` (``special``: add the tokenizer's
        special tokens to that text). Raises :class:`EncodeError`."""
        if not self._queued and sum(map(len, texts)) <= self.inline_chars:
            return self._encode_all(texts, special)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._queued += 1
        try:
            # Jobs finish in submission order, and their waiters resume in that order.
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self._encode_all, texts, special)
        finally:
            self._queued -= 1

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
