"""``python -m worker``: serve the reference worker (simulated engine, real prefix cache)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from gateway.config import SettingsError
from worker.server import create_app
from worker.settings import parse_settings
from worker.tokenizer import TokenizerUnavailableError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
        app = create_app(settings)
    except (SettingsError, TokenizerUnavailableError) as exc:
        print(f"python -m worker: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    print(
        f"worker {settings.effective_worker_id}: engine={settings.engine} (simulated) "
        f"model={settings.model} cache={settings.cache_blocks}x{settings.block_size} tokens "
        f"max_running={settings.max_running}",
        flush=True,
    )
    web.run_app(app, host=settings.host, port=settings.port, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
