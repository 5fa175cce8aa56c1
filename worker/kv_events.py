"""The worker's KV-cache events, published like vLLM's ``ZmqEventPublisher`` does.

With ``--kv-events tcp://*:5557`` the worker binds a ZMQ PUB socket and publishes every change
of its prefix cache (:class:`~worker.kvcache.CacheListener`): ``BlockStored`` (block hashes,
parent hash, token ids, block size; the cache namespace in the first block's ``extra_keys``),
``BlockRemoved`` and ``AllBlocksCleared``. Events of one event-loop tick go out as one batch,
``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` (:mod:`gateway.contracts.kv_wire`), as
vLLM sends one batch per engine step. With ``--kv-replay tcp://*:5558`` a ROUTER socket serves
the last ``buffer_steps`` batches to a subscriber that missed some.

With data-parallel ranks each rank's cache has a publisher of its own, bound where vLLM's
rank binds it (:func:`worker.ranks.rank_endpoint`), and its batches carry the rank in
``data_parallel_rank``.

The PUB socket never blocks the event loop: above its high-water mark ZMQ drops batches, and
subscribers see the gap in the sequence numbers and ask the replay socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from gateway.contracts.kv_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
    encode_seq,
)

log = logging.getLogger(__name__)


class KVEventPublisher:
    """A :class:`~worker.kvcache.CacheListener` that publishes on ZMQ (start/close it on the
    event loop that drives the cache)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        *,
        block_size: int,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: list[Event] = []
        self._seq = 0
        self._flush_scheduled = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.published = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self._hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)
        if self.replay_endpoint:
            self._actx = zmq.asyncio.Context()
            router = self._actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replay(router),
                                                    name="kv-events-replay")
        log.info("publishing KV events on %s (replay: %s)", self.endpoint,
                 self.replay_endpoint or "none")

    async def close(self) -> None:
        self._flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                # Closes the sockets still open too: a replay socket whose bind failed, or
                # whose task was cancelled before it ran (closed right after start()).
                ctx.destroy(linger=0)
        self._ctx = self._actx = None

    # -- CacheListener --------------------------------------------------------------------------
    def stored(
        self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], namespace: str
    ) -> None:
        extra: tuple[tuple[str, ...] | None, ...] | None = None
        if namespace and parent is None:
            extra = ((namespace,), *([None] * (len(hashes) - 1)))
        self._add(BlockStored(
            block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens),
            block_size=self.block_size, extra_keys=extra,
        ))

    def removed(self, hashes: Sequence[int]) -> None:
        self._add(BlockRemoved(block_hashes=tuple(hashes)))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    # -- publishing -----------------------------------------------------------------------------
    def _add(self, event: Event) -> None:
        self._pending.append(event)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending or self._pub is None:
            return
        batch = EventBatch(time.time(), tuple(self._pending), self.data_parallel_rank)
        self._pending.clear()
        seq = self._seq
        self._seq += 1
        payload = encode_batch(batch)
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        self.published += 1

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await router.recv_multipart()
                if len(frames) != 3:
                    log.warning("invalid KV-event replay request (%d frames)", len(frames))
                    continue
                client, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await router.send_multipart((client, b"", encode_seq(seq), payload))
                await router.send_multipart((client, b"", END_SEQ, b""))
        finally:
            router.close(linger=0)
