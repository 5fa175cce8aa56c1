"""Subscriptions to the workers' KV-event publishers (ZMQ), feeding the exact index.

One :class:`WorkerFeed` per worker that announces an event endpoint (its registry record, or a
``#kv-events=...`` option on its ``--worker`` URL). A feed runs on the gateway's event loop
(``zmq.asyncio``) and keeps the worker's :class:`~gateway.kvevents.index.WorkerBlocks` in step:

* **Bootstrap**: with a replay endpoint, it first asks for every buffered batch from sequence
  0, so a gateway that starts (or restarts) in front of a warm engine learns what it holds.
  Without one the feed goes live at its first message.
* **Order**: batches must come in sequence. A skipped number is a gap: the feed asks the
  replay socket for the missing batches; if they are gone (the buffer moved on) or the
  socket does not answer, the block set is emptied and rebuilt from the events that follow.
* **Restart**: a sequence number that goes backwards means a new publisher (the engine
  restarted, its cache is empty): the block set is emptied. So is it when the pool marks the
  worker down, and the next batch bootstraps again.

* **Keeping up**: a wake-up of the feed applies every batch the socket holds, not one (on a
  busy event loop the feed would otherwise fall seconds behind its engine), and a decision
  that reads a worker's blocks first applies what its engine published up to then
  (:meth:`WorkerFeed.drain_now`, through :meth:`ExactIndex.refresh`): a non-blocking read of
  the socket, no turn of the loop needed.

Routing uses a worker's events only while its feed is *live* (bootstrapped, in order); until
then, and for workers without events, the modelled index stands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from gateway.contracts.kv_wire import END_SEQ, WireError, decode_batch, decode_seq
from gateway.kvevents.endpoints import EventEndpoints
from gateway.kvevents.index import ExactIndex, WorkerBlocks

log = logging.getLogger(__name__)

_POLL_MS = 200
_DRAIN_MAX = 512  # batches applied per wake-up of a feed before the loop gets a turn
_RETRY_S = 1.0  # between bootstrap attempts while the replay socket does not answer
# What one engine may make the gateway hold and apply. A batch over _MAX_MESSAGE_BYTES (a
# vLLM batch of a 200k-token prefill is about 1 MB) is lost: live, it is dropped unread; in a
# replay it drops the replay's connection (ZMQ_MAXMSGSIZE; not on the live socket, which
# libzmq would then close for good). A replay answer over _MAX_REPLAY_BYTES is given up, as
# one that fell silent is.
_MAX_MESSAGE_BYTES = 16 << 20
_MAX_REPLAY_BYTES = 256 << 20
_APPLY_SLICE = 256  # replayed batches applied per turn of the event loop


@dataclass(slots=True)
class FeedStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    unreplayable: int = 0
    restarts: int = 0
    bad_messages: int = 0
    reads: int = 0  # wake-ups (or decisions) that applied at least one batch
    last_seq: int = -1
    last_batch_at: float = 0.0  # time.monotonic()


@dataclass(slots=True)
class WorkerFeed:
    worker_id: str
    endpoints: EventEndpoints
    index: ExactIndex
    ctx: zmq.asyncio.Context
    replay_timeout_s: float = 1.0
    stats: FeedStats = field(default_factory=FeedStats)
    state: str = "connecting"  # connecting | resync | live | stopped
    _last: int | None = None  # sequence number of the last batch applied
    _dedupe_until: int = -1  # live batches up to here came in a replay already
    _gap_start: int | None = None  # a replay to make before the next live batch
    _reset: bool = False
    _after_loss: bool = False  # batches were lost: start again from whatever comes next
    _tried_at: float = 0.0  # last bootstrap attempt (time.monotonic())
    _drained: int = 0  # batches the last wake-up applied
    _reader: zmq.Socket[bytes] | None = None  # set while the feed waits for a batch

    @property
    def blocks(self) -> WorkerBlocks:
        return self.index.worker(self.worker_id)

    def reset(self) -> None:
        """Forget the worker's blocks and bootstrap again (it went down; it may restart)."""
        self._reset = True
        self.index.set_live(self.worker_id, False)
        self.blocks.clear()

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoints.events)
        # Non-blocking reads of the same socket: the feed's own wake-ups, and the decisions
        # (drain_now) while the feed waits for the next batch.
        reader: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        self.index.set_refresh(self.worker_id, self.drain_now)
        try:
            await self._bootstrap()
            while True:
                if self._reset:
                    self._reset = False
                    self._last = None
                    self._dedupe_until = -1
                    await self._bootstrap()
                if self._gap_start is not None:
                    start, self._gap_start = self._gap_start, None
                    await self._fill_gap(start)
                    continue
                self._reader = reader
                try:
                    ready = await sub.poll(_POLL_MS)
                finally:
                    self._reader = None
                if not ready:
                    if self.state == "connecting" and self.endpoints.replay \
                            and time.monotonic() - self._tried_at >= _RETRY_S:
                        await self._bootstrap()  # the replay socket may answer now
                    continue
                self._drain(reader)
                if self._gap_start is None and self._drained == _DRAIN_MAX:
                    await asyncio.sleep(0)  # a flood: let the requests in between
        finally:
            self.state = "stopped"
            self._reader = None
            self.index.set_refresh(self.worker_id, None)
            self.index.set_live(self.worker_id, False)
            sub.close(linger=0)

    def drain_now(self) -> None:
        """Apply what the engine published up to now, before a decision reads the index
        (a no-op while the feed bootstraps or fills a gap)."""
        reader = self._reader
        if reader is not None and self._gap_start is None:
            self._drain(reader)

    def _drain(self, reader: zmq.Socket[bytes]) -> None:
        """Apply every batch the socket holds, up to ``_DRAIN_MAX`` (stopping at a gap, which
        needs the replay socket). One wake-up of the feed reads all the engine published
        since the last: on a busy event loop, a batch per wake-up falls ever further behind
        the engine, and the events correct the view seconds too late."""
        drained = 0
        while drained < _DRAIN_MAX and self._gap_start is None and not self._reset:
            try:
                frames = reader.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            drained += 1
            self._on_message(frames)
        self._drained = drained
        if drained:
            self.stats.reads += 1

    async def _bootstrap(self) -> None:
        """Everything the publisher still buffers, from sequence 0 (what came before is lost:
        its blocks stay unknown, which can only under-predict)."""
        if not self.endpoints.replay:
            self.state = "connecting"  # live at the first batch
            return
        self.state = "resync"
        self._tried_at = time.monotonic()
        replayed = await self._replay(0)
        if replayed is None:
            log.warning("kv events of %s: replay endpoint %s did not answer; waiting for the "
                        "live feed", self.worker_id, self.endpoints.replay)
            self.state = "connecting"
            return
        batches, _ = replayed
        await self._apply_all(batches)
        if not self._reset:
            self._go_live()

    def _go_live(self) -> None:
        if self.state != "live":
            log.info("kv events of %s are live (last seq %s, %d blocks)", self.worker_id,
                     self._last, len(self.blocks))
        self.state = "live"
        self.index.set_live(self.worker_id, True)

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise WireError(f"expected 3 frames, got {len(frames)}")
            seq = decode_seq(frames[1])
        except WireError as exc:
            self.stats.bad_messages += 1
            log.debug("kv events of %s: bad message: %s", self.worker_id, exc)
            return
        last = self._last
        if seq <= self._dedupe_until:
            return  # applied from a replay already
        self._dedupe_until = -1
        if last is not None and seq <= last:
            self.stats.restarts += 1
            log.info("kv events of %s restarted at seq %d (was %d): block set emptied",
                     self.worker_id, seq, last)
            self.blocks.clear()
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            self._gap_start = last + 1
            return  # this batch comes again in the replay
        elif last is None and seq > 0 and self.endpoints.replay and not self._after_loss:
            self._gap_start = 0  # joined after the publisher started: fetch what came before
            return
        if len(frames[2]) > _MAX_MESSAGE_BYTES:
            self.stats.bad_messages += 1
            self._lose(seq)
            return
        self._after_loss = False
        self._apply(seq, frames[2])
        self._go_live()

    def _lose(self, start: int) -> None:
        """Batches from ``start`` are lost: removals may be among them, so what the block
        set says is no longer safe. It is rebuilt from the events that follow."""
        self.stats.unreplayable += 1
        log.warning("kv events of %s: batches from seq %d are lost; block set rebuilt "
                    "from the events that follow", self.worker_id, start)
        self.blocks.clear()
        self._last = None
        self._after_loss = True

    async def _fill_gap(self, start: int) -> None:
        replayed = await self._replay(start)
        if replayed is None or not replayed[1]:
            self._lose(start)
        if replayed is not None:
            await self._apply_all(replayed[0])
        if not self._reset:
            self._go_live()

    async def _apply_all(self, batches: list[tuple[int, bytes]]) -> None:
        """Apply replayed ``batches`` in order, giving the event loop a turn every
        ``_APPLY_SLICE`` of them (a replay buffer holds thousands); a reset meanwhile (the
        worker went down) stops it, and the feed bootstraps again."""
        for i, (seq, payload) in enumerate(batches):
            if i and not i % _APPLY_SLICE:
                await asyncio.sleep(0)
                if self._reset:
                    return
            if self._last is None or seq > self._last:
                self._apply(seq, payload)
                self.stats.replayed += 1
        if self._last is not None:
            self._dedupe_until = self._last

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        self.stats.last_seq = seq
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self.stats.bad_messages += 1
            log.debug("kv events of %s: bad batch %d: %s", self.worker_id, seq, exc)
            return
        blocks, now = self.blocks, time.monotonic()
        blocks.begin_batch(batch.ts, now)
        for event in batch.events:
            blocks.apply(event, now)
        blocks.end_batch()
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_batch_at = now

    async def _replay(self, start: int) -> tuple[list[tuple[int, bytes]], bool] | None:
        """The buffered batches from ``start`` and whether they reach back to it; None when
        there is no replay socket, it fell silent for ``replay_timeout_s`` before its end, or
        its answer grew past ``_MAX_REPLAY_BYTES``.
        The timeout is between frames, not for the whole answer: a buffer of thousands of
        batches, read on a busy loop while other feeds bootstrap, takes longer than a second
        to arrive, and a replay given up then loses what came before for good (the blocks
        stored then stay unknown, and every block stored under them is an orphan)."""
        if not self.endpoints.replay:
            return None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        dealer.connect(self.endpoints.replay)
        batches: list[tuple[int, bytes]] = []
        size = 0
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not await dealer.poll(left_ms):
                    return None
                frames = await dealer.recv_multipart()
                deadline = time.monotonic() + self.replay_timeout_s
                if len(frames) == 3 and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    self.stats.bad_messages += 1
                    continue
                if frames[0] == END_SEQ:
                    break
                size += len(frames[1])
                if size > _MAX_REPLAY_BYTES:
                    self.stats.bad_messages += 1
                    log.warning("kv events of %s: replay from seq %d is over %d MiB; given up",
                                self.worker_id, start, _MAX_REPLAY_BYTES >> 20)
                    return None
                batches.append((decode_seq(frames[0]), frames[1]))
        finally:
            dealer.close(linger=0)
        complete = (batches[0][0] <= start) if batches else start == 0
        return batches, complete


class KVEventHub:
    """All feeds of one gateway: started and stopped as the pool's workers come and go."""

    def __init__(self, index: ExactIndex, replay_timeout_s: float = 1.0) -> None:
        self.index = index
        self._ctx: zmq.asyncio.Context | None = None
        self._feeds: dict[str, tuple[WorkerFeed, asyncio.Task[None]]] = {}
        self._replay_timeout_s = replay_timeout_s

    def feed(self, worker_id: str) -> WorkerFeed | None:
        entry = self._feeds.get(worker_id)
        return entry[0] if entry is not None else None

    def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()

    def sync(self, wanted: dict[str, EventEndpoints]) -> None:
        """Subscribe to ``wanted`` (worker id -> endpoints); drop every other feed."""
        for wid in list(self._feeds):
            feed, _ = self._feeds[wid]
            if wanted.get(wid) != feed.endpoints:
                self._stop(wid)
        if self._ctx is None:
            return
        for wid, endpoints in wanted.items():
            if wid not in self._feeds:
                feed = WorkerFeed(wid, endpoints, self.index, self._ctx,
                                  replay_timeout_s=self._replay_timeout_s)
                task = asyncio.create_task(self._guarded(feed), name=f"kv-events-{wid}")
                self._feeds[wid] = (feed, task)

    async def _guarded(self, feed: WorkerFeed) -> None:
        while True:
            try:
                await feed.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events of %s: feed failed; reconnecting", feed.worker_id)
                feed.blocks.clear()
                await asyncio.sleep(1.0)

    def worker_down(self, worker_id: str) -> None:
        feed = self.feed(worker_id)
        if feed is not None:
            feed.reset()

    def _stop(self, wid: str) -> None:
        _, task = self._feeds.pop(wid)
        task.cancel()
        self.index.drop(wid)

    async def close(self) -> None:
        tasks = [task for _, task in self._feeds.values()]
        for wid in list(self._feeds):
            self._stop(wid)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
