"""``python -m gateway``: serve the gateway until Ctrl-C (graceful drain on shutdown)."""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from gateway.app import create_app
from gateway.settings import parse_settings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except ValueError as exc:
        print(f"python -m gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not settings.worker and settings.store.startswith("memory://"):
        print(
            "python -m gateway: give at least one --worker URL, or a --store redis://... "
            "where workers register themselves",
            file=sys.stderr,
        )
        return 2
    base = f"http://{settings.host}:{settings.port}"
    web.run_app(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        shutdown_timeout=settings.shutdown_timeout_s,
        print=lambda _: print(
            f"gateway listening on {base} (policy {settings.policy}, "
            f"{len(settings.worker)} static workers, store {settings.store})",
            flush=True,
        ),
        access_log=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
