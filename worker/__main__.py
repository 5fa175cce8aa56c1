"""``python -m worker``: serve the reference worker (sim or torch engine, real prefix cache)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from gateway.contracts.config import SettingsError
from gateway.contracts.httpserver import run
from worker.engines.base import EngineUnavailableError
from worker.server import ENGINE_KEY, create_app
from worker.settings import parse_settings
from worker.tokenizer import TokenizerUnavailableError
from worker.vllm_launcher import launch

# Pending connections the kernel queues for accept(); aiohttp's 128 drops SYNs when a gateway
# opens hundreds of connections at once (which then time out connecting).
LISTEN_BACKLOG = 2048
SHUTDOWN_TIMEOUT_S = 60.0  # in-flight requests get this long to finish on SIGTERM


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" belongs to the engine (``--engine vllm -- <vllm serve args>``).
    engine_args = args[args.index("--") + 1 :] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    try:
        settings = parse_settings(args)
        if settings.engine == "vllm":
            logging.basicConfig(level=logging.INFO,
                                format="%(asctime)s %(levelname)s %(name)s %(message)s")
            return asyncio.run(launch(settings, engine_args))
        app = create_app(settings)
    except (SettingsError, TokenizerUnavailableError, EngineUnavailableError) as exc:
        print(f"python -m worker: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = app[ENGINE_KEY]
    cache = engine.stats().cache
    kind = "simulated" if settings.engine == "sim" else "real model"
    ranks = settings.data_parallel_size
    per_rank = f" per rank, {ranks} data-parallel ranks" if ranks > 1 else ""
    print(
        f"worker {settings.effective_worker_id}: engine={settings.engine} ({kind}) "
        f"model={settings.model} cache={cache.num_blocks}x{cache.block_size} tokens{per_rank} "
        f"max_running={settings.max_running} {engine.info()}",
        flush=True,
    )
    # aiohttp's own errors (malformed HTTP, huge headers) answered in the OpenAI error shape,
    # aborted uploads logged as one line; SIGTERM drains in-flight requests.
    run(app, host=settings.host, port=settings.port, backlog=LISTEN_BACKLOG,
        shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
