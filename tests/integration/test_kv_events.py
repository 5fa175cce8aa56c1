"""KV events over real ZMQ sockets: the worker publishes, the gateway's feed keeps the exact
index in step, fills gaps from the replay socket, and starts over after a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from gateway.contracts.kv_keys import chain_seed, token_block_keys
from gateway.contracts.kv_wire import END_SEQ
from gateway.kvevents import subscriber
from gateway.kvevents.endpoints import EventEndpoints
from gateway.kvevents.index import ExactIndex, ExactMatcher
from gateway.kvevents.subscriber import KVEventHub, WorkerFeed
from gateway.routing.prefix_index import PrefixIndex
from tests.conftest import FAST_WORKER, free_port, serve
from worker.kv_events import KVEventPublisher
from worker.server import ENGINE_KEY, _cache_of
from worker.server import create_app as create_worker

BS = 16


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def hub() -> AsyncIterator[KVEventHub]:
    h = KVEventHub(ExactIndex(), replay_timeout_s=0.5)
    h.start()
    yield h
    await h.close()


async def complete(url: str, prompt: list[int]) -> int:
    async with aiohttp.ClientSession() as s, s.post(
        f"{url}/v1/completions", json={"model": FAST_WORKER.model, "prompt": prompt,
                                       "max_tokens": 1},
    ) as r:
        assert r.status == 200
        return int(r.headers["x-cache-matched-tokens"])


async def test_worker_events_give_the_exact_depth(hub: KVEventHub) -> None:
    ev, rp = free_port(), free_port()
    port = free_port()
    settings = dataclasses.replace(
        FAST_WORKER, port=port, cache_blocks=64,
        kv_events=f"tcp://127.0.0.1:{ev}", kv_replay=f"tcp://127.0.0.1:{rp}",
    )
    runner = await serve(create_worker(settings), port)
    url = f"http://127.0.0.1:{port}"
    try:
        # Traffic before the gateway subscribes: the replay bootstrap must recover it.
        early = list(range(1000, 1000 + 5 * BS))
        await complete(url, early)
        hub.sync({"w": EventEndpoints(f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")})
        blocks = hub.index.worker("w")
        seed = chain_seed()
        await eventually(lambda: hub.index.is_live("w"))
        assert blocks.depth(token_block_keys(early, BS, seed), 0.0) == 5
        # Prompts sharing prefixes, more than the cache holds: predictions stay exact.
        feed = hub.feed("w")
        assert feed is not None
        stats = feed.stats
        mismatches = 0
        for i in range(40):
            prompt = list(range(i % 5 * BS * 3)) + [i] * (BS * 2 + 3)
            await eventually(lambda: stats.last_seq + 1 == _published(runner))
            predicted = blocks.depth(token_block_keys(prompt, BS, seed), 0.0) * BS
            reported = await complete(url, prompt)
            mismatches += predicted != reported
        assert mismatches == 0
        assert blocks.stats.removed > 0  # evictions were seen
        # A batch published while the subscription was still joining is a gap, filled by replay.
        assert stats.unreplayable == 0
    finally:
        await runner.cleanup()


def _published(runner: web.AppRunner) -> int:
    """Batches the worker's publisher has sent so far."""
    assert runner.app is not None
    listener = _cache_of(runner.app[ENGINE_KEY]).listener
    assert isinstance(listener, KVEventPublisher)
    return listener.published


class Publisher:
    """A vLLM-like publisher built from raw sockets: sends chosen sequence numbers."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ev, self.rp = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.ev}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.rp}")
        self.buffer: dict[int, bytes] = {}
        self.task = asyncio.create_task(self._serve())

    @property
    def endpoints(self) -> EventEndpoints:
        return EventEndpoints(f"tcp://127.0.0.1:{self.ev}", f"tcp://127.0.0.1:{self.rp}")

    @staticmethod
    def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
        event = ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None]
        return msgspec.msgpack.encode([0.0, [event], 0])

    async def send(self, seq: int, payload: bytes, *, deliver: bool = True) -> None:
        self.buffer[seq] = payload
        if deliver:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq in sorted(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [client, b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([client, b"", END_SEQ, b""])

    async def close(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        self.ctx.destroy(linger=0)


@pytest.fixture
async def publisher() -> AsyncIterator[Publisher]:
    p = Publisher()
    yield p
    await p.close()


def chain(n: int) -> tuple[list[int], list[int]]:
    tokens = list(range(n * BS))
    return tokens, token_block_keys(tokens, BS, chain_seed())


async def test_gap_is_filled_from_the_replay_socket(
    hub: KVEventHub, publisher: Publisher
) -> None:
    tokens, keys = chain(3)
    hub.sync({"w": publisher.endpoints})
    await eventually(lambda: hub.index.is_live("w"))
    await asyncio.sleep(0.2)  # the SUB socket joins
    await publisher.send(0, publisher.stored([1], None, tokens[:BS]))
    await publisher.send(1, publisher.stored([2], 1, tokens[BS : 2 * BS]), deliver=False)
    await publisher.send(2, publisher.stored([3], 2, tokens[2 * BS :]))
    blocks = hub.index.worker("w")
    await eventually(lambda: blocks.depth(keys, 0.0) == 3)
    feed = hub.feed("w")
    assert feed is not None
    assert (feed.stats.gaps, feed.stats.unreplayable) == (1, 0)


async def test_unreplayable_gap_rebuilds_and_restart_empties(
    hub: KVEventHub, publisher: Publisher
) -> None:
    tokens, keys = chain(2)
    hub.sync({"w": publisher.endpoints})
    await eventually(lambda: hub.index.is_live("w"))
    await asyncio.sleep(0.2)
    await publisher.send(0, publisher.stored([1, 2], None, tokens))
    blocks = hub.index.worker("w")
    await eventually(lambda: blocks.depth(keys, 0.0) == 2)
    # Batch 1 removed block 2, and the publisher's buffer lost it.
    publisher.buffer.clear()
    await publisher.send(2, publisher.stored([9], None, list(range(500, 500 + BS))))
    feed = hub.feed("w")
    assert feed is not None
    await eventually(lambda: feed.stats.unreplayable == 1)
    assert blocks.depth(keys, 0.0) == 0  # not trusted any more
    # A new publisher (the engine restarted) counts from 0 again.
    await publisher.send(3, publisher.stored([1, 2], None, tokens))
    await eventually(lambda: blocks.depth(keys, 0.0) == 2)
    await publisher.send(0, publisher.stored([7], None, list(range(900, 900 + BS))))
    await eventually(lambda: feed.stats.restarts == 1)
    assert blocks.depth(keys, 0.0) == 0


async def test_a_restarted_worker_is_followed_again(hub: KVEventHub) -> None:
    ev, rp, port = free_port(), free_port(), free_port()
    settings = dataclasses.replace(
        FAST_WORKER, port=port, cache_blocks=64,
        kv_events=f"tcp://127.0.0.1:{ev}", kv_replay=f"tcp://127.0.0.1:{rp}",
    )
    url = f"http://127.0.0.1:{port}"
    prompt = list(range(3 * BS))
    keys = token_block_keys(prompt, BS, chain_seed())
    runner = await serve(create_worker(settings), port)
    try:
        hub.sync({"w": EventEndpoints(f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")})
        await eventually(lambda: hub.index.is_live("w"))
        await complete(url, prompt)
        blocks = hub.index.worker("w")
        await eventually(lambda: blocks.depth(keys, 0.0) == 3)
        await runner.cleanup()
        hub.worker_down("w")  # the pool saw it go
        assert not hub.index.is_live("w")
        assert blocks.depth(keys, 0.0) == 0
        runner = await serve(create_worker(settings), port)
        await eventually(lambda: hub.index.is_live("w"))  # bootstraps from the new engine
        assert blocks.depth(keys, 0.0) == 0
        assert await complete(url, prompt) == 0
        await eventually(lambda: blocks.depth(keys, 0.0) == 3)
    finally:
        await runner.cleanup()


def _stored_batch(publisher: Publisher, i: int) -> bytes:
    return publisher.stored([i + 1], None, list(range(i * BS, (i + 1) * BS)))


async def test_a_backlog_is_applied_at_one_wake_up(
    hub: KVEventHub, publisher: Publisher
) -> None:
    hub.sync({"w": publisher.endpoints})
    await eventually(lambda: hub.index.is_live("w"))
    await asyncio.sleep(0.2)  # the SUB socket joins
    feed = hub.feed("w")
    assert feed is not None
    n = 100
    for i in range(n):  # sent without yielding to the loop
        await publisher.send(i, _stored_batch(publisher, i))
    time.sleep(0.3)  # noqa: ASYNC251 (the gateway's loop is busy while the batches arrive)
    await eventually(lambda: feed.stats.batches == n)
    # Not one wake-up of the feed per batch: a busy loop would fall ever further behind.
    assert feed.stats.reads < n // 4
    blocks = hub.index.worker("w")
    assert all(blocks.depth([token_block_keys(list(range(i * BS, (i + 1) * BS)), BS,
                                              chain_seed())[0]], 0.0) == 1 for i in range(n))


async def test_a_decision_applies_what_was_published_before_it(
    hub: KVEventHub, publisher: Publisher
) -> None:
    hub.sync({"w": publisher.endpoints})
    await eventually(lambda: hub.index.is_live("w"))
    await asyncio.sleep(0.2)
    tokens, keys = chain(3)
    await publisher.send(0, publisher.stored([1, 2, 3], None, tokens))
    blocks = hub.index.worker("w")
    # The loop never gets a turn here (as while a decision is made): only reading the
    # socket from the decision's side can apply the batch.
    for _ in range(500):
        hub.index.refresh("w")
        if blocks.depth(keys, 0.0) == 3:
            break
        time.sleep(0.01)  # noqa: ASYNC251 (no turn for the loop)
    assert blocks.depth(keys, 0.0) == 3
    # The matchers refresh before they read: a removal published now is seen at once.
    await publisher.send(1, msgspec.msgpack.encode([0.0, [["BlockRemoved", [3], "GPU"]], 0]))
    exact = ExactMatcher(PrefixIndex().at(0.0), hub.index, 0.0)
    for _ in range(500):
        if exact.held("w", keys) == 2:
            break
        time.sleep(0.01)  # noqa: ASYNC251 (no turn for the loop)
    assert exact.held("w", keys) == 2



async def test_a_replay_that_keeps_coming_is_read_to_its_end() -> None:
    """The replay timeout is the socket's silence between frames, not the whole answer: a
    replay socket that streams 20 batches 30 ms apart (0.6 s in all) is read to its end with
    a 0.2 s timeout, and one that falls silent mid-way gives no answer."""
    ctx = zmq.asyncio.Context()
    port = free_port()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")

    async def serve_replay(batches: int, silent_after: int) -> None:
        ident, _, _ = await router.recv_multipart()
        for seq in range(batches):
            if seq == silent_after:
                return
            await asyncio.sleep(0.03)
            await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), b"payload"])
        await router.send_multipart([ident, b"", END_SEQ, b""])

    feed = WorkerFeed("w", EventEndpoints("tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}"),
                      ExactIndex(), ctx, replay_timeout_s=0.2)
    try:
        server = asyncio.create_task(serve_replay(20, silent_after=-1))
        replayed = await feed._replay(0)
        await server
        assert replayed is not None
        batches, complete_ = replayed
        assert [seq for seq, _ in batches] == list(range(20))
        assert complete_
        server = asyncio.create_task(serve_replay(20, silent_after=5))
        assert await feed._replay(0) is None
        await server
    finally:
        router.close(linger=0)
        ctx.term()


async def test_a_replay_past_its_byte_cap_is_given_up(
    publisher: Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's replay answer is read up to a cap in bytes, then given up as one that
    fell silent is: the gateway never holds more of one engine's replay than that."""
    for i in range(8):
        await publisher.send(i, _stored_batch(publisher, i), deliver=False)
    size = len(_stored_batch(publisher, 0))
    feed = WorkerFeed("w", publisher.endpoints, ExactIndex(), publisher.ctx,
                      replay_timeout_s=0.5)
    replayed = await feed._replay(0)
    assert replayed is not None
    assert len(replayed[0]) == 8
    monkeypatch.setattr(subscriber, "_MAX_REPLAY_BYTES", 5 * size)
    assert await feed._replay(0) is None
    assert feed.stats.bad_messages == 1


async def test_an_oversized_batch_is_lost(
    hub: KVEventHub, publisher: Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch over the message cap is never applied: live, it is a loss (the block set is
    rebuilt from the batches after it); in a replay, it drops the replay's connection and
    the replay gives no answer."""
    monkeypatch.setattr(subscriber, "_MAX_MESSAGE_BYTES", 4096)
    hub.sync({"w": publisher.endpoints})
    await eventually(lambda: hub.index.is_live("w"))
    await asyncio.sleep(0.2)  # the SUB socket joins
    feed = hub.feed("w")
    assert feed is not None
    blocks = hub.index.worker("w")
    first = token_block_keys(list(range(BS)), BS, chain_seed())
    await publisher.send(0, _stored_batch(publisher, 0))
    await eventually(lambda: blocks.depth(first, 0.0) == 1)
    huge = list(range(4000))
    assert len(publisher.stored([77], None, huge)) > 4096
    await publisher.send(1, publisher.stored([77], None, huge))
    await eventually(lambda: feed.stats.unreplayable == 1)
    assert blocks.depth(first, 0.0) == 0  # not trusted any more
    await publisher.send(2, _stored_batch(publisher, 2))
    key = token_block_keys(list(range(2 * BS, 3 * BS)), BS, chain_seed())
    await eventually(lambda: blocks.depth(key, 0.0) == 1)
    assert blocks.depth(token_block_keys(huge[:BS], BS, chain_seed()), 0.0) == 0
    assert feed.stats.bad_messages == 1
    replaying = WorkerFeed("r", publisher.endpoints, ExactIndex(), publisher.ctx,
                           replay_timeout_s=0.3)
    assert await replaying._replay(2) is not None  # batches of their usual size
    assert await replaying._replay(0) is None  # batch 1 is in it


async def test_a_long_replay_gives_the_loop_turns() -> None:
    """Thousands of replayed batches are applied a slice at a time: requests go on
    meanwhile."""
    ctx = zmq.asyncio.Context()
    feed = WorkerFeed("w", EventEndpoints("tcp://127.0.0.1:1"), ExactIndex(), ctx)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    n = 4 * subscriber._APPLY_SLICE
    batches = [(i, Publisher.stored([i + 1], None, list(range(i * BS, (i + 1) * BS))))
               for i in range(n)]
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        before = ticks
        await feed._apply_all(batches)
        assert ticks - before >= 3
        assert feed.stats.replayed == n
        assert feed._last == n - 1
    finally:
        task.cancel()
        ctx.term()
