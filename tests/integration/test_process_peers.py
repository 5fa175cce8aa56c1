"""The processes of one gateway send each other their decisions as they are made: real Unix
datagram sockets in a private directory, and the store sync of two processes over a real hub."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from gateway.fingerprint import Namespace, fingerprint
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.store.base import Assignment
from gateway.store.hub import HubServer, HubStore
from gateway.store.peers import PeerLink
from gateway.sync import StoreSync

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _decision(i: int, blocks: int = 3) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return (f"w{i % 2}", tuple(range(i * 1000, i * 1000 + blocks)), ())


def _received(origin: str, *decisions: tuple[str, tuple[int, ...], tuple[int, ...]]) -> list[
        tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    return [(origin, *d) for d in decisions]


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Callable[..., PeerLink]]:
    """Makes processes' links in ``tmp_path`` (as if each were another process) and closes
    them all at the end."""
    made: list[PeerLink] = []

    def make(refresh_s: float = 0.25) -> PeerLink:
        made.append(PeerLink(str(tmp_path), origin=f"p{len(made)}", refresh_s=refresh_s))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_a_decision_is_there_at_the_other_process_at_once(link: Callable[..., PeerLink]) -> None:
    a, b = link(), link()
    assert b.receive() == []
    a.publish("w0", (1, 2, 3), (1, 2, 5))
    assert b.receive() == [("p0", "w0", (1, 2, 3), (1, 2, 5))]  # no event loop in between
    assert a.receive() == []  # nothing echoed to the sender
    assert (a.sent, b.received) == (1, 1)


def test_a_full_queue_holds_decisions_for_the_next_datagrams(
    link: Callable[..., PeerLink],
) -> None:
    """Far more than any socket buffer holds, sent without the peer reading: nothing is
    lost or reordered, the rest waits for the next datagrams."""
    a, b = link(), link()
    sent = [_decision(i, blocks=400) for i in range(3000)]  # ~10 MB
    for wid, blocks, depths in sent:
        a.publish(wid, blocks, depths)
    assert a.deferred > 0
    assert a.pending > 0
    got = b.receive()
    for _ in range(1000):
        if not a.pending:
            break
        a.flush()
        got += b.receive()
    got += b.receive()
    assert got == _received("p0", *sent)
    assert a.dropped == 0


def test_a_process_that_left_is_forgotten_and_one_that_came_is_found(
    link: Callable[..., PeerLink],
) -> None:
    a, b = link(refresh_s=0.0), link(refresh_s=0.0)
    a.publish(*_decision(1))
    assert a.peers == [b.path]
    b.close()
    a.publish(*_decision(2))
    assert a.peers == []
    c = link(refresh_s=0.0)
    a.publish(*_decision(3))
    assert c.receive() == _received("p0", _decision(3))


def test_a_malformed_datagram_is_ignored(link: Callable[..., PeerLink]) -> None:
    b = link()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
        raw.sendto(b"\xc1 not msgpack", b.path)
        raw.sendto(b"\x91\x92\xa1x\x01", b.path)  # a list of the wrong shape
    a = link()
    a.publish(*_decision(4))
    assert b.receive() == _received("p1", _decision(4))


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[list[StoreSync]]]]:
    """Two processes' store syncs over one real hub in ``tmp_path``; the arguments: where they
    put their decision sockets, and whether they are all that share the store."""
    hub = HubServer(str(tmp_path / "store.sock"))
    await hub.start()
    syncs: list[StoreSync] = []

    async def start(directory: str, peers_only: bool = True) -> list[StoreSync]:
        for origin in ("p1", "p2"):
            index = PrefixIndex()
            store = HubStore(hub.url)
            await store.start()
            sync = StoreSync(store, WorkerPool(URLS, index), index, origin=origin,
                             tokens_per_block=16.0, peer_dir=directory, peers_only=peers_only)
            await sync.start()
            syncs.append(sync)
        return syncs

    yield start
    for sync in syncs:
        await sync.stop()
        await sync.store.close()
    await hub.close()


async def test_a_process_decides_with_the_others_decisions_up_to_that_instant(
    processes: Callable[..., Awaitable[list[StoreSync]]], tmp_path: Path
) -> None:
    """What one process routed is in the other's index at its next decision, without that
    process's event loop running in between (its stream reads wait on the loop)."""
    a, b = await processes(str(tmp_path))
    wid = next(iter(a.pool.states())).worker.id
    key = fingerprint("the tariff of the rail company " * 30, Namespace(model="m"))
    a.assigned(key, wid)
    now = time.monotonic()
    b.catch_up(now)  # synchronous: no await since the decision
    assert b.index.match(key.blocks, now) == {wid: len(key.blocks)}
    a.catch_up(now)
    assert a.index.match(key.blocks, now) == {}  # its own decision is not echoed
    assert a.peers is not None
    a.peers.publish(wid, (7, 8, 9), (1, 2))  # depths that do not fit its checkpoints
    b.catch_up(now)
    assert b.index.match((7, 8, 9), now) == {}
    assert a.peers.sent == 2


async def test_without_a_socket_decisions_still_reach_the_other_process(
    processes: Callable[..., Awaitable[list[StoreSync]]], tmp_path: Path
) -> None:
    """Processes that cannot bind their sockets (here: the directory is gone; in practice a
    socket path over the system's length limit, which all of them share) fall back to the
    hub's stream, and still learn each other's decisions."""
    a, b = await processes(str(tmp_path / "missing"))
    assert a.peers is None
    assert b.peers is None
    wid = next(iter(a.pool.states())).worker.id
    key = fingerprint("the timetable of the ferry company " * 30, Namespace(model="m"))
    a.assigned(key, wid)
    deadline = time.monotonic() + 5.0
    while not b.index.holds(wid, key.blocks[-1]):
        assert time.monotonic() < deadline, "not learnt through the stream within 5 s"
        await asyncio.sleep(0.01)


async def test_with_a_store_others_share_the_stream_brings_only_theirs(
    processes: Callable[..., Awaitable[list[StoreSync]]], tmp_path: Path
) -> None:
    """With Redis, gateways on other hosts share the stream too: a process reads it, and
    skips the decisions of the processes it hears through the sockets (recorded once)."""
    a, b = await processes(str(tmp_path), peers_only=False)
    wid = next(iter(a.pool.states())).worker.id
    mine = fingerprint("the schedule of the tram company " * 30, Namespace(model="m"))
    a.assigned(mine, wid)
    b.catch_up(time.monotonic())
    assert b.index.holds(wid, mine.blocks[-1])
    # Another host's replica publishes on the stream only.
    theirs = fingerprint("the fares of the bus company " * 30, Namespace(model="m"))
    await b.store.publish_assignments([Assignment("elsewhere", wid, theirs.blocks,
                                                  theirs.depths)])
    deadline = time.monotonic() + 5.0
    while not b.index.holds(wid, theirs.blocks[-1]):
        assert time.monotonic() < deadline, "the other host's decision not read within 5 s"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # a's own decision has reached the stream by now, and was read
    assert b.index.recent_requests(wid, time.monotonic()) == pytest.approx(2.0, abs=0.05)
