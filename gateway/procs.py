"""Several gateway processes behind one port (``python -m gateway --procs N``).

The parent process binds nothing: it starts ``N`` copies of ``python -m gateway`` with the same
arguments plus ``--procs 1 --reuse-port``, and the kernel spreads connections over them
(``SO_REUSEPORT``). Each copy is a replica with its own event loop, prefix index and health
checks; they keep affinity with each other the way replicas do:

* with a Redis store (``--store redis://...``) through Redis, as separate gateways would;
* with the embedded default (``memory://``) through a hub the parent serves on a Unix socket
  (:mod:`gateway.store.hub`): the parent owns the shared state (load, telemetry, the stream of
  decisions a restarting replica replays).

With either store, each replica also sends the others every decision as it makes it, through
the parent's private directory (:mod:`gateway.store.peers`), so a prefix routed by one process
is a prefix hit in all of them from their next decision on.

The parent restarts a replica that dies, forwards SIGINT/SIGTERM to all of them (each drains its
in-flight requests) and exits when they have; a replica whose parent is gone shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

from gateway.settings import GatewaySettings
from gateway.store.hub import HubServer

log = logging.getLogger(__name__)

PARENT_ENV = "GATEWAY_PARENT_PID"
# The parent's private directory: the replicas' decision sockets (gateway.store.peers).
PEER_DIR_ENV = "GATEWAY_PEER_DIR"
_RESTART_DELAY_S = 1.0


def replica_command(argv: Sequence[str], store: str) -> list[str]:
    """The command line of one replica: the parent's arguments, then the overrides (last wins)."""
    return [sys.executable, "-m", "gateway", *argv, "--procs", "1", "--reuse-port",
            "--store", store]


class Supervisor:
    def __init__(self, settings: GatewaySettings, argv: Sequence[str]) -> None:
        self.settings = settings
        self.argv = list(argv)
        self._stopping = asyncio.Event()
        self._children: dict[int, asyncio.subprocess.Process] = {}
        self._private = ""  # the private directory, while it exists

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        with tempfile.TemporaryDirectory(prefix="gateway-hub-") as private:  # mode 0700
            self._private = private
            hub: HubServer | None = None
            store = self.settings.store
            if store.startswith("memory://"):
                hub = HubServer(os.path.join(private, "store.sock"))
                await hub.start()
                store = hub.url
            try:
                slots = [asyncio.create_task(self._keep(i, store))
                         for i in range(self.settings.procs)]
                await self._stopping.wait()
                await self._stop_children()
                for slot in slots:
                    slot.cancel()
                await asyncio.gather(*slots, return_exceptions=True)
            finally:
                if hub is not None:
                    await hub.close()
        return 0

    async def _keep(self, slot: int, store: str) -> None:
        """Run replica ``slot``; start it again if it dies while the gateway is up."""
        env = {**os.environ, PARENT_ENV: str(os.getpid()), PEER_DIR_ENV: self._private}
        while not self._stopping.is_set():
            proc = await asyncio.create_subprocess_exec(
                *replica_command(self.argv, store), stdin=asyncio.subprocess.DEVNULL, env=env)
            self._children[slot] = proc
            code = await proc.wait()
            if self._stopping.is_set():
                return
            log.warning("gateway process %d (pid %d) exited with %s; starting it again",
                        slot, proc.pid, code)
            await asyncio.sleep(_RESTART_DELAY_S)

    async def _stop_children(self) -> None:
        live = [p for p in self._children.values() if p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)),
                                   self.settings.shutdown_timeout_s + 5)
        except TimeoutError:
            for proc in live:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()


def run_supervisor(settings: GatewaySettings, argv: Sequence[str]) -> int:
    print(f"gateway: {settings.procs} processes on http://{settings.host}:{settings.port} "
          f"(SO_REUSEPORT), store {settings.store}", flush=True)
    return asyncio.run(Supervisor(settings, argv).run())


def peer_dir() -> str:
    """In a replica started by :class:`Supervisor`: the directory where the replicas send
    each other their decisions (:mod:`gateway.store.peers`); "" elsewhere."""
    return os.environ.get(PEER_DIR_ENV, "") if os.environ.get(PARENT_ENV) else ""


def watch_parent(loop: asyncio.AbstractEventLoop, interval_s: float = 1.0) -> None:
    """In a replica started by :class:`Supervisor`: shut down (SIGTERM to itself, a graceful
    drain) once the parent process is gone."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return

    def check() -> None:
        if os.getppid() != int(parent):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        loop.call_later(interval_s, check)

    loop.call_later(interval_s, check)
