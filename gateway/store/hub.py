"""The embedded store shared by the processes of one gateway (``python -m gateway --procs N``).

The parent process owns the shared state (:class:`HubState`: the stream of prefix assignments,
each process's in-flight load, hit telemetry, the rebalancer lease, the worker registry) and
serves it on a Unix socket in a private directory. Each serving process reaches it through
:class:`HubStore`, a :class:`~gateway.store.base.MetadataStore` like the Redis one, so
:class:`~gateway.sync.StoreSync` keeps the processes' prefix indexes and load views in step
exactly as it does for replicas sharing Redis: routing itself never waits on the hub.

Frames: a 4-byte big-endian length, then a pickle of ``(call id, method, args)`` one way and
``(call id, ok, result)`` the other. Pickle is used only between the processes of one gateway,
over a socket in a directory only its user can enter.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import struct
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.store.base import (
    Assignment,
    CacheReport,
    StoreUnavailable,
    Telemetry,
    WorkerRecord,
)
from gateway.store.memory import MemoryStore

log = logging.getLogger(__name__)

SCHEME = "hub://"
_HEADER = struct.Struct(">I")
_MAX_FRAME = 64 * 1024 * 1024
_STREAM_LIMIT = 10_000  # assignments kept for readers that fall behind (read every ~20 ms)
# What a client may call: the MetadataStore methods, nothing else.
_METHODS = frozenset({
    "register_worker", "deregister_worker", "list_workers", "publish_assignments",
    "read_assignments", "recent_assignments", "publish_load", "read_load", "add_telemetry",
    "read_telemetry", "try_lead", "lease", "pin", "pinned", "unpin", "log_action",
    "recent_actions",
})


class HubState(MemoryStore):
    """The state behind the hub: a memory store that also keeps what processes share."""

    def __init__(self) -> None:
        super().__init__()
        self._stream: deque[tuple[int, Assignment]] = deque(maxlen=_STREAM_LIMIT)
        self._seq = 0
        self._new = asyncio.Event()
        self._load: dict[str, tuple[dict[str, int], float]] = {}
        self._leader: tuple[str, float] = ("", 0.0)

    async def publish_assignments(self, batch: Sequence[Assignment]) -> None:
        for a in batch:
            self._seq += 1
            self._stream.append((self._seq, a))
        if batch:
            self._new.set()
            self._new = asyncio.Event()

    async def read_assignments(self, cursor: str, block_s: float) -> tuple[str, list[Assignment]]:
        start = int(cursor) if cursor else self._seq
        if self._seq <= start and block_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), block_s)
        fresh = [a for seq, a in self._stream if seq > start] if self._seq > start else []
        return str(self._seq), fresh

    async def recent_assignments(
        self, max_age_s: float, limit: int
    ) -> tuple[str, list[Assignment]]:
        """The newest ``limit`` assignments (the hub keeps no ages: it lives only as long as
        the processes it serves)."""
        recent = list(self._stream)[-limit:] if limit > 0 else []
        return str(self._seq), [a for _, a in recent]

    async def publish_load(self, origin: str, load: Mapping[str, int], ttl_s: float) -> None:
        self._load[origin] = (dict(load), time.monotonic() + ttl_s)

    async def read_load(self, exclude_origin: str) -> dict[str, int]:
        now = time.monotonic()
        total: dict[str, int] = {}
        for origin, (load, expiry) in list(self._load.items()):
            if expiry < now:
                del self._load[origin]
            elif origin != exclude_origin:
                for wid, tokens in load.items():
                    total[wid] = total.get(wid, 0) + tokens
        return total

    async def try_lead(self, origin: str, ttl_s: float) -> bool:
        leader, expiry = self._leader
        now = time.monotonic()
        if leader in ("", origin) or expiry < now:
            self._leader = (origin, now + ttl_s)
            return True
        return False


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_FRAME:
        raise ValueError(f"hub frame of {size} bytes")
    return pickle.loads(await reader.readexactly(size))


def _frame(value: Any) -> bytes:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class HubServer:
    """Serves a :class:`HubState` on a Unix socket until closed."""

    def __init__(self, path: str, state: HubState | None = None) -> None:
        self.path = path
        self.state = state or HubState()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return SCHEME + self.path

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                call_id, method, args = await _read_frame(reader)
                task = asyncio.create_task(self._answer(writer, call_id, method, args))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, pickle.PickleError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, method: str,
                      args: tuple[Any, ...]) -> None:
        try:
            if method not in _METHODS:
                raise ValueError(f"no hub method {method!r}")
            result: Any = await getattr(self.state, method)(*args)
            reply = (call_id, True, result)
        except Exception as exc:  # the caller gets it as StoreUnavailable
            reply = (call_id, False, f"{type(exc).__name__}: {exc}")
        if not writer.is_closing():
            writer.write(_frame(reply))


class HubStore:
    """A process's connection to the hub: the :class:`MetadataStore` protocol over the socket."""

    unreadable = 0  # the hub holds only what its processes wrote

    def __init__(self, url: str, *, call_timeout_s: float = 5.0) -> None:
        if not url.startswith(SCHEME):
            raise ValueError(f"a hub URL looks like {SCHEME}/path/to/socket, got {url!r}")
        self._url = url
        self._path = url.removeprefix(SCHEME)
        self._timeout_s = call_timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()

    @property
    def url(self) -> str:
        return self._url

    async def start(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self._connect()

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        self._drop(StoreUnavailable("hub connection closed"))

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return self._writer
            try:
                reader, writer = await asyncio.open_unix_connection(self._path)
            except OSError as exc:
                raise StoreUnavailable(f"hub {self._path}: {exc}") from exc
            self._writer = writer
            self._reader_task = asyncio.create_task(self._read_replies(reader),
                                                    name="hub-replies")
            return writer

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        error: Exception = StoreUnavailable("hub connection lost")
        try:
            while True:
                call_id, ok, result = await _read_frame(reader)
                future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(result)
                    else:
                        future.set_exception(StoreUnavailable(str(result)))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError,
                pickle.PickleError) as exc:
            error = StoreUnavailable(f"hub connection lost: {exc}")
        finally:
            self._drop(error)

    def _drop(self, error: Exception) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        writer = await self._connect()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        writer.write(_frame((call_id, method, args)))
        try:
            return await asyncio.wait_for(future, self._timeout_s + wait_s)
        except TimeoutError as exc:
            raise StoreUnavailable(f"hub call {method} timed out") from exc
        finally:
            self._pending.pop(call_id, None)

    # -- MetadataStore --------------------------------------------------------------------------
    async def register_worker(self, record: WorkerRecord, ttl_s: float) -> None:
        await self._call("register_worker", record, ttl_s)

    async def deregister_worker(self, worker_id: str) -> None:
        await self._call("deregister_worker", worker_id)

    async def list_workers(self) -> list[WorkerRecord]:
        result: list[WorkerRecord] = await self._call("list_workers")
        return result

    async def publish_assignments(self, batch: Sequence[Assignment]) -> None:
        await self._call("publish_assignments", list(batch))

    async def read_assignments(self, cursor: str, block_s: float) -> tuple[str, list[Assignment]]:
        result: tuple[str, list[Assignment]] = await self._call(
            "read_assignments", cursor, block_s, wait_s=block_s)
        return result

    async def recent_assignments(
        self, max_age_s: float, limit: int
    ) -> tuple[str, list[Assignment]]:
        result: tuple[str, list[Assignment]] = await self._call(
            "recent_assignments", max_age_s, limit)
        return result

    async def publish_load(self, origin: str, load: Mapping[str, int], ttl_s: float) -> None:
        await self._call("publish_load", origin, dict(load), ttl_s)

    async def read_load(self, exclude_origin: str) -> dict[str, int]:
        result: dict[str, int] = await self._call("read_load", exclude_origin)
        return result

    async def add_telemetry(self, reports: Sequence[CacheReport]) -> None:
        await self._call("add_telemetry", list(reports))

    async def read_telemetry(self) -> Telemetry:
        result: Telemetry = await self._call("read_telemetry")
        return result

    async def try_lead(self, origin: str, ttl_s: float) -> bool:
        return bool(await self._call("try_lead", origin, ttl_s))

    async def lease(self, name: str, value: str, ttl_s: float, replace: bool = False) -> str:
        return str(await self._call("lease", name, value, ttl_s, replace))

    async def pin(self, name: str, worker_id: str, ttl_s: float) -> None:
        await self._call("pin", name, worker_id, ttl_s)

    async def pinned(self, name: str) -> str | None:
        result: str | None = await self._call("pinned", name)
        return result

    async def unpin(self, name: str) -> None:
        await self._call("unpin", name)

    async def log_action(self, action: Mapping[str, object], keep: int) -> None:
        await self._call("log_action", dict(action), keep)

    async def recent_actions(self, limit: int) -> list[dict[str, object]]:
        result: list[dict[str, object]] = await self._call("recent_actions", limit)
        return result
