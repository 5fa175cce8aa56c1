"""``python -m gateway``: serve the gateway until Ctrl-C (graceful drain on shutdown)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import socket
import sys

from gateway.app import TLS_KEY, create_app
from gateway.contracts.httpserver import ConnectionCap, client_connection_cap, run
from gateway.contracts.redact import redact_url
from gateway.procs import run_supervisor, watch_parent
from gateway.settings import GatewaySettings, parse_settings
from gateway.telemetry import access_log

log = logging.getLogger(__name__)


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """uvloop's loop (``auto``: when it is installed), else asyncio's own.

    uvloop runs the same aiohttp code with its transports and scheduling in C, which roughly
    halves the event loop's share of the gateway's CPU time per request.
    """
    if choice in ("auto", "uvloop"):
        try:
            uvloop = importlib.import_module("uvloop")
        except ImportError:
            if choice == "uvloop":
                raise
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


# Allocations between two young-generation collections (CPython's default is 700). A request
# allocates a few hundred objects that reference counting frees at once; at 700 the collector
# ran every few requests and walked what survived, which made about 7% of the gateway's CPU.
GC_YOUNG_THRESHOLD = 50_000


def quiet_collector() -> None:
    """Collect the cyclic garbage less often, and never again walk what start-up built: the
    imported modules, the app and its settings (``gc.freeze``). Long-lived routing state (the
    prefix index's nodes) reaches the oldest generation, which is collected only when it has
    grown by a quarter."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def serve(settings: GatewaySettings) -> int:
    scheme = "https" if settings.tls_cert_file else "http"
    base = f"{scheme}://{settings.host}:{settings.port}"
    loop = new_event_loop(settings.event_loop)
    asyncio.set_event_loop(loop)
    connections = ConnectionCap(client_connection_cap(settings.max_client_connections,
                                                      settings.max_connections))
    try:
        app = create_app(settings, connections=connections)
    except ValueError as exc:  # a bad worker URL, tokenizer, keys or secret file
        print(f"python -m gateway: {exc}", file=sys.stderr)
        loop.close()
        return 2
    tls = app[TLS_KEY]
    keys = bool(settings.api_key or settings.api_keys_file)
    if keys and tls is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("API keys are configured but the client port speaks plain HTTP on %s: "
                    "keys cross the network readable; give --tls-cert-file and "
                    "--tls-key-file, or terminate TLS in front of the gateway", settings.host)
    watch_parent(loop)
    quiet_collector()
    # The admin port listens on loopback only; requests arriving there are admin requests.
    admin = [
        socket.create_server(("127.0.0.1", settings.admin_port),
                             reuse_port=settings.reuse_port or settings.procs > 1)
    ] if settings.admin_port else []
    run(
        app,
        host=settings.host,
        port=settings.port,
        extra_sockets=admin,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        on_ready=lambda: print(
            f"gateway listening on {base} (policy {settings.policy}, "
            f"{len(settings.worker)} static workers, "
            + (f"pods {settings.k8s_selector!r}, " if settings.k8s_selector else "")
            + f"store {redact_url(settings.store)}, "
            f"loop {type(loop).__module__.split('.')[0]})"
            + (f", admin on 127.0.0.1:{settings.admin_port}" if admin else ""),
            flush=True,
        ),
        reuse_port=settings.reuse_port or None,
        backlog=LISTEN_BACKLOG,
        loop=loop,
        idle_timeout_s=settings.idle_timeout_s,
        cap=connections,
        ssl_context=tls.context if tls is not None else None,
    )
    return 0


# Pending connections the kernel queues for accept(); aiohttp's 128 drops SYNs when hundreds
# of clients connect at once (they then wait a 1 s SYN retransmit, or time out).
LISTEN_BACKLOG = 2048


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_settings(argv)
    except ValueError as exc:
        print(f"python -m gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    access_log.configure_stream()  # access lines bare on stdout, one per request
    if (not settings.worker and settings.store.startswith("memory://")
            and not settings.k8s_selector):
        print(
            "python -m gateway: give at least one --worker URL, a --k8s-selector for the "
            "pods to use, or a --store redis://... where workers register themselves",
            file=sys.stderr,
        )
        return 2
    if settings.procs > 1:
        return run_supervisor(settings, argv)
    try:
        return serve(settings)
    except ImportError as exc:
        print(f"python -m gateway: --event-loop uvloop: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
