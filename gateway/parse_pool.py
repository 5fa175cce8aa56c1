"""Requests made of very many items are parsed on a thread, not on the event loop.

Checking, normalizing and rendering a request is Python per item: about a microsecond per chat
message or batch prompt. A body at the default ``--max-body-bytes`` (8 MiB) can hold a quarter
of a million one-character messages or a million and a half one-character prompts, whose parse
would hold the event loop, and every other request with it, for a third to two thirds of a
second. :class:`ParsePool` counts a decoded body's items (chat messages not already known from
an earlier turn, their content parts, tools, batch prompts), and a body with at least
``min_items`` of them is parsed on the pool's one thread. The interpreter hands the lock it
holds to the waiting event loop every few milliseconds (``sys.getswitchinterval``), so other
requests go on meanwhile; one thread means such parses take turns, so a burst of them still
leaves the loop its share.

The thread's parse is the same function, with nothing remembered: no per-tenant memo of
normal texts, no chat or prompt history (those are the event loop's), so it touches no state
another request reads. What it returns, or the error it raises, is what the event loop's
parse would have. Decoding the JSON stays on the loop: the decoder holds the interpreter's
lock for the whole call wherever it runs (0.1 s for 8 MiB of tiny items).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.normalize import NormalizeOptions
from gateway.openai_schema import ParsedRequest

# Items from which a body is parsed on the thread (``--parse-thread-items``): about 4 ms of
# parse on the event loop.
MIN_ITEMS = 4096

PlainParser = Callable[[dict[str, Any], NormalizeOptions], ParsedRequest]


def item_count(body: dict[str, Any], known_messages: int = 0) -> int:
    """The items of ``body`` whose parse costs Python per item: its chat messages past the
    first ``known_messages`` (an earlier turn parsed those), their content parts, its tools
    and its batch prompts. Cheap next to the parse (one pass over the new messages)."""
    count = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        new = messages[known_messages:] if known_messages else messages
        count += len(new)
        for message in new:
            if isinstance(message, dict) and isinstance(parts := message.get("content"), list):
                count += len(parts)
    tools = body.get("tools")
    if isinstance(tools, list):
        count += len(tools)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        count += len(prompt)
        if prompt and isinstance(prompt[0], list):  # lists of token ids
            count += sum(len(p) for p in prompt if isinstance(p, list))
    return count


class ParsePool:
    """One thread for the parses of bodies of at least ``min_items`` items (0: never)."""

    def __init__(self, min_items: int = MIN_ITEMS) -> None:
        if min_items < 0:
            raise ValueError("min_items must be >= 0")
        self.min_items = min_items
        self.parsed = 0  # bodies parsed on the thread
        self._pool: ThreadPoolExecutor | None = None

    def wants(self, body: dict[str, Any], size: int, known_messages: int = 0) -> bool:
        """Whether ``body`` (``size`` bytes of JSON) is parsed on the thread. Every item takes
        two bytes at least (a digit and a comma): a smaller body is not even counted."""
        return (bool(self.min_items) and size >= 2 * self.min_items
                and item_count(body, known_messages) >= self.min_items)

    async def parse(self, parse: PlainParser, body: dict[str, Any],
                    opts: NormalizeOptions) -> ParsedRequest:
        """``parse(body, opts)`` on the pool's thread; its error is raised here."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="parse")
        self.parsed += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, parse, body, opts)

    def close(self) -> None:
        """Stop the thread (a parse in progress finishes; no new one starts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
