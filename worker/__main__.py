"""``python -m worker``: serve the reference worker (sim or torch engine, real prefix cache)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from gateway.config import SettingsError
from worker.engines.base import EngineUnavailableError
from worker.server import ENGINE_KEY, create_app
from worker.settings import parse_settings
from worker.tokenizer import TokenizerUnavailableError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
        app = create_app(settings)
    except (SettingsError, TokenizerUnavailableError, EngineUnavailableError) as exc:
        print(f"python -m worker: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = app[ENGINE_KEY]
    cache = engine.stats().cache
    kind = "simulated" if settings.engine == "sim" else "real model"
    print(
        f"worker {settings.effective_worker_id}: engine={settings.engine} ({kind}) "
        f"model={settings.model} cache={cache.num_blocks}x{cache.block_size} tokens "
        f"max_running={settings.max_running} {engine.info()}",
        flush=True,
    )
    web.run_app(app, host=settings.host, port=settings.port, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
