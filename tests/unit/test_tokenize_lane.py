"""The worker tokenizes requests in the order they arrived (vLLM's one tokenizer thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker.tokenize_lane import EncodeError, TokenizeLane
from worker.tokenizer import HashTokenizer


class SlowFirstTokenizer(HashTokenizer):
    """A test stand-in: texts starting with "slow" take 50 ms to encode; records the threads
    that encoded."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        self.threads.add(threading.current_thread().name)
        if text.startswith("slow"):
            time.sleep(0.05)
        if "\x00" in text:
            raise ValueError("NUL in text")
        return super().encode(text, special=special)


async def _in_order(lane: TokenizeLane, texts: list[str]) -> list[int]:
    done: list[int] = []

    async def one(i: int) -> None:
        await lane.encode([texts[i]], [False])
        done.append(i)

    async with asyncio.TaskGroup() as group:
        for i in range(len(texts)):
            group.create_task(one(i))
            await asyncio.sleep(0)  # each request starts before the next arrives
    return done


async def test_a_long_request_is_not_overtaken_by_later_ones() -> None:
    tokenizer = SlowFirstTokenizer()
    lane = TokenizeLane(tokenizer, inline_chars=100)
    try:
        texts = ["slow " + "x" * 200, "fast " + "y" * 200, "short"]
        assert await _in_order(lane, texts) == [0, 1, 2]
        # The long texts went to the lane's thread; nothing ran in a second one.
        assert len(tokenizer.threads - {threading.current_thread().name}) == 1
    finally:
        lane.close()


async def test_short_texts_on_an_idle_lane_are_encoded_inline() -> None:
    tokenizer = SlowFirstTokenizer()
    lane = TokenizeLane(tokenizer, inline_chars=100)
    try:
        ids = await lane.encode(["hello world", "again"], [False, False])
        assert ids == [tokenizer.encode("hello world"), tokenizer.encode("again")]
        assert tokenizer.threads == {threading.current_thread().name}
    finally:
        lane.close()


@pytest.mark.parametrize("inline_chars", [0, 1000])
async def test_the_rejected_text_is_named(inline_chars: int) -> None:
    lane = TokenizeLane(SlowFirstTokenizer(), inline_chars=inline_chars)
    try:
        with pytest.raises(EncodeError) as info:
            await lane.encode(["fine", "bad \x00"], [False, False])
        assert info.value.index == 1
        # The lane goes on after a failure.
        assert await lane.encode(["fine"], [False]) == [HashTokenizer().encode("fine")]
    finally:
        lane.close()
