"""Prefix assignments between the processes of one gateway, as they are made.

The processes of ``--procs N`` could share their routing decisions through the hub's stream
alone (:mod:`gateway.store.hub`), as replicas do through Redis, but a process reads that stream
on its event loop, and under load one loop iteration takes tens of milliseconds: a process then
decides without the others' last few dozen decisions. Each worker's cache is modelled from every
process's decisions, so when a cache turns over in a fraction of a second (long prompts at a
high rate), those missing decisions are churn the model does not see, and it predicts hits on
prefixes already evicted (Mooncake 16 x 500 replayed at full speed: 0.89-0.92 of the pooled
bound with two processes against 0.97-0.99 with one). The stream now only serves the history a
restarting process replays.

:class:`PeerLink` sends each decision to the other processes at once, as a datagram on a Unix
socket in the hub's private directory (only the gateway's user can enter it), and a process
reads what the others sent right before each decision of its own: a non-blocking read of its
socket, whatever its event loop is doing. The kernel queues few datagrams per socket
(``net.unix.max_dgram_qlen``, often 10); when a peer's queue is full, the decisions for it
wait, and go with the next datagrams once it reads again (a timer of the sync retries them).
Each decision is encoded once; a batch is a msgpack array of those encodings.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

log = logging.getLogger(__name__)

# One decision: the process that made it (its replica id), the worker, the prompt's checkpoint
# hashes and their depths (PrefixKey).
Decision = tuple[str, str, tuple[int, ...], tuple[int, ...]]

_PREFIX = "peer-"
_SUFFIX = ".sock"
_SOCKET_BUFFER = 4 << 20  # bytes asked for (the kernel caps it at net.core.[rw]mem_max)
_MAX_DATAGRAM = 128 * 1024  # a longer batch goes as several datagrams
_MAX_PENDING = 10_000  # decisions held for a peer that reads nothing (the oldest go first)


def _array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` items (< 2**16)."""
    return bytes((0x90 | count,)) if count < 16 else b"\xdc" + count.to_bytes(2, "big")


@dataclass(slots=True)
class _Peer:
    pending: deque[bytes] = field(default_factory=deque)  # encoded decisions not sent yet
    blocked: bool = False  # its queue was full at the last try: wait for ``flush``


class PeerLink:
    """This process's socket in ``directory`` and the other processes' sockets there."""

    def __init__(self, directory: str, origin: str = "", refresh_s: float = 0.25) -> None:
        self.directory = directory
        self.origin = origin
        self.path = os.path.join(
            directory, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{_SUFFIX}")
        self._refresh_s = refresh_s
        self._refreshed = -float("inf")
        self._peers: dict[str, _Peer] = {}  # socket path -> what waits for it
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[Decision])
        self.sent = self.received = self.deferred = self.dropped = 0
        self._buffer = bytearray(_MAX_DATAGRAM)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                with contextlib.suppress(OSError):
                    self._sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
            self._sock.bind(self.path)
        except OSError:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    @property
    def pending(self) -> int:
        """Decisions waiting for a peer whose queue was full."""
        return sum(len(p.pending) for p in self._peers.values())

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # -- sending ------------------------------------------------------------------------------

    def publish(self, worker_id: str, blocks: Sequence[int], depths: Sequence[int]) -> None:
        """Send one decision to every other process now (or with its next batch)."""
        now = time.monotonic()
        if now - self._refreshed >= self._refresh_s:
            self._refresh(now)
        item = self._encoder.encode((self.origin, worker_id, blocks, depths))
        if len(item) > _MAX_DATAGRAM - 8:  # longer than any datagram a process reads
            self.dropped += 1
            return
        for path, peer in list(self._peers.items()):
            peer.pending.append(item)
            if len(peer.pending) > _MAX_PENDING:
                peer.pending.popleft()
                self.dropped += 1
            if not peer.blocked:
                self._send(path, peer)

    def flush(self) -> None:
        """Send what waits for peers whose queues were full."""
        for path, peer in list(self._peers.items()):
            peer.blocked = False
            if peer.pending:
                self._send(path, peer)

    def _refresh(self, now: float) -> None:
        """Pick up processes that started, drop those whose socket is gone."""
        self._refreshed = now
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        found = {os.path.join(self.directory, n) for n in names
                 if n.startswith(_PREFIX) and n.endswith(_SUFFIX)} - {self.path}
        for path in found - self._peers.keys():
            self._peers[path] = _Peer()
        for path in self._peers.keys() - found:
            del self._peers[path]

    def _send(self, path: str, peer: _Peer) -> None:
        """Send ``peer``'s pending decisions in order, as few datagrams as fit; what its full
        queue does not take stays pending."""
        pending = peer.pending
        while pending:
            size = count = 0
            for item in pending:
                if count == 0xFFFF or size + len(item) > _MAX_DATAGRAM - 8:
                    break
                size += len(item)
                count += 1
            data = _array_header(count) + b"".join(itertools.islice(pending, count))
            try:
                self._sock.sendto(data, path)
            except BlockingIOError:  # its queue is full: these go with the next datagrams
                peer.blocked = True
                self.deferred += 1
                return
            except FileNotFoundError:  # that process is gone
                self._peers.pop(path, None)
                return
            except ConnectionRefusedError:  # gone, without removing its socket: remove it
                self._peers.pop(path, None)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                return
            except OSError as exc:
                log.warning("decisions for the process at %s not sent: %s", path, exc)
                self.dropped += len(pending)
                pending.clear()
                return
            self.sent += count
            for _ in range(count):
                pending.popleft()

    # -- receiving ----------------------------------------------------------------------------

    def receive(self) -> list[Decision]:
        """Everything the other processes sent since the last call (never waits)."""
        out: list[Decision] = []
        buffer = memoryview(self._buffer)
        while True:
            try:
                size = self._sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.warning("reading other processes' decisions failed: %s", exc)
                break
            try:
                out.extend(self._decoder.decode(buffer[:size]))
            except msgspec.DecodeError:
                log.warning("a malformed datagram on %s was ignored", self.path)
        self.received += len(out)
        return out
