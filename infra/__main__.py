"""``python -m infra``: start and manage the workers the gateway routes to."""

from __future__ import annotations

import argparse
import asyncio
import sys

from infra.local import LocalCluster, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infra", description=__doc__)
    targets = parser.add_subparsers(dest="target", required=True)
    local = targets.add_parser("local", help="workers as processes on this machine")
    actions = local.add_subparsers(dest="action", required=True)
    run = actions.add_parser(
        "serve", help="run N workers and a gateway in the foreground until Ctrl-C",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--workers", type=int, default=4, help="number of reference workers")
    run.add_argument("--host", default="127.0.0.1", help="address for all servers")
    run.add_argument("--port", type=int, default=8000, help="gateway port")
    run.add_argument("--worker-base-port", type=int, default=8001,
                     help="first worker port; worker i listens on base + i")
    run.add_argument("--policy", default="prefix_affinity", help="gateway routing policy")
    run.add_argument("--model", default="sim-model", help="model name the workers serve")
    run.add_argument("--cache-blocks", type=int, default=2048, help="KV blocks per worker")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("python -m infra: --workers must be >= 1", file=sys.stderr)
        return 2
    cluster = LocalCluster(
        host=args.host,
        gateway_port=args.port,
        worker_base_port=args.worker_base_port,
        workers=args.workers,
        policy=args.policy,
        model=args.model,
        cache_blocks=args.cache_blocks,
    )
    return asyncio.run(serve(cluster))


if __name__ == "__main__":
    sys.exit(main())
