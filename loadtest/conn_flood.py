"""New clients against a flood of connections held open without requests.

``python -m loadtest.conn_flood [--cap N] [--flood F] [--clients C] [--checkout DIR]`` starts
one reference worker and the gateway (``--max-client-connections N``; from the checkout in
``DIR`` if given, to compare with another version), opens ``F`` connections that send nothing
or trickle a request's head (one in four) and holds them, then sends ``C`` requests one after
another, each on a new connection, as new clients do. It prints how many were served and how
many refused, and the gateway's own counts of refused and evicted connections. A measurement,
not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from infra.procs import HOST, free_port_block, start_server, stop_processes

MODEL = "flood-model"
_BODY = b'{"model": "flood-model", "prompt": "hi", "max_tokens": 1}'


async def _client(host: str, port: int) -> str:
    """One request on a new connection: its status line's code, or why there was none."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return type(exc).__name__
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(_BODY), _BODY))
        answer = await asyncio.wait_for(reader.read(), 30)
        return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
    except (OSError, TimeoutError) as exc:
        return type(exc).__name__
    finally:
        writer.close()


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def run(cap: int, flood: int, clients: int, checkout: Path) -> None:
    base = free_port_block(3)
    worker, gateway = f"http://{HOST}:{base}", f"http://{HOST}:{base + 1}"
    procs: list[asyncio.subprocess.Process] = []
    held: list[asyncio.StreamWriter] = []
    with tempfile.TemporaryDirectory(prefix="conn-flood-") as logs:
        try:
            await start_server([sys.executable, "-m", "worker", "--host", HOST, "--port",
                                str(base), "--model", MODEL], worker, Path(logs) / "worker.log",
                               procs, timeout_s=120.0)
            # The gateway's code: this checkout's or DIR's (run from there, it is found first).
            await start_server(["env", "-C", str(checkout), sys.executable, "-m", "gateway",
                                "--port", str(base + 1),
                                "--worker", worker, "--access-log", "off",
                                "--max-client-connections", str(cap),
                                "--admin-port", str(base + 2)],
                               gateway, Path(logs) / "gateway.log", procs, timeout_s=120.0)
            for i in range(flood):
                with contextlib.suppress(OSError):
                    _, writer = await asyncio.open_connection(HOST, base + 1)
                    if i % 4 == 3:
                        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: ga")
                    held.append(writer)
            await asyncio.sleep(1.0)
            answers = collections.Counter([await _client(HOST, base + 1)
                                           for _ in range(clients)])
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://{HOST}:{base + 2}/metrics") as r:
                metrics = await r.text()
        finally:
            for writer in held:
                writer.close()
            await stop_processes(procs)
    print(f"cap {cap}, {len(held)} connections held without requests, {clients} new clients "
          f"one after another ({checkout}):")
    print("  answers: " + ", ".join(f"{n} x {s}" for s, n in sorted(answers.items())))
    print(f"  gateway: {_counter(metrics, 'gateway_refused_connections_total'):.0f} refused, "
          f"{_counter(metrics, 'gateway_evicted_connections_total'):.0f} evicted")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=int, default=200)
    parser.add_argument("--flood", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--checkout", type=Path, help="run the gateway from this checkout")
    args = parser.parse_args(argv)
    checkout = args.checkout or Path(__file__).resolve().parent.parent
    asyncio.run(run(args.cap, args.flood, args.clients, checkout.resolve()))


if __name__ == "__main__":
    main()
