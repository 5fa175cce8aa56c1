"""Where one request's time goes inside the gateway at one request in flight.

``python -m loadtest.phases [--requests N] [--gateway-arg=FLAG ...] [--checkpoint
MODULE:ATTR[:LABEL] ...]`` starts four zero-cost reference workers and the gateway in front of
them with a checkpoint before and after each of the functions in :data:`CHECKPOINTS` (and each
``--checkpoint``), sends ``N`` sequential chat requests (2,000-character
system prompts, as ``bench_overhead`` does) on one keep-alive socket, and prints, for the
requests after the first fifth, the median wall time between consecutive checkpoints, in the
order a request passes them, the median from the first checkpoint to the last, and the
gateway's CPU per request. Spans before the write to the worker and after its answer are on
the client's time; the span to the worker's reply holds the worker's.

Why not a sampling profiler: at one request in flight every part of the gateway runs with cold
caches between two requests, and a wall-clock sampler charges the time the gateway is preempted
(by the worker it has just woken, on a shared core) to whatever it was doing, mostly the write
to the worker. Checkpoints give each span its own median. Each costs about a microsecond, which
the spans include; compare runs of this tool with each other, not with ``bench_overhead``.

``python -m loadtest.phases --serve LOG -- GATEWAY-ARGS`` is the gateway side: it installs the
checkpoints, runs ``python -m gateway GATEWAY-ARGS`` in this process and writes the log (one
line per checkpoint: label and nanoseconds) to LOG when the gateway exits.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import itertools
import json
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from infra.procs import free_port_block, start_server, stop_processes
from loadtest.bench_overhead import OverheadConfig, bodies_for
from loadtest.harness import HOST, MODEL, ZERO_COST_WORKER_ARGS
from loadtest.peers import proc_tree_cpu_s

# (module, attribute path, label): the functions timed, in the order a request reaches them.
CHECKPOINTS: tuple[tuple[str, str, str], ...] = (
    ("gateway.app", "begin", "middleware"),
    ("gateway.api", "read_body", "body"),
    ("gateway.api", "decode_json_object", "decode"),
    ("gateway.api", "prepare", "parse+fingerprint"),
    ("gateway.session", "RoutingSession.decide", "decide"),
    ("gateway.backends.http1", "_Connection.send", "write to worker"),
    ("gateway.session", "RoutingSession.commit", "commit"),
    ("gateway.backends.http1", "_Connection.wait_head", "worker's reply"),
    ("gateway.proxy", "_read_whole", "read answer"),
    ("gateway.proxy", "_respond_whole", "response object"),
    ("gateway.app", "_send", "write to client"),
    ("gateway.telemetry.record", "RequestRecord.sent", "after sent"),
    ("gateway.telemetry.record", "Telemetry.finish", "telemetry"),
)
WORKERS = 4


def resolve(module: str, path: str) -> tuple[Any, str, Callable[..., Any]]:
    """The object that holds the function ``module``.``path`` names, its attribute name, and
    the function (AttributeError when the name no longer exists)."""
    owner: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name, getattr(owner, name)


def install(log: list[tuple[str, int]],
            extra: Sequence[tuple[str, str, str]] = ()) -> None:
    """Wrap every function of :data:`CHECKPOINTS` and ``extra`` so that it appends
    ``(label>, ns)`` to ``log`` as it starts and ``(label<, ns)`` as it returns (an awaited
    one: as its await ends)."""
    clock = time.perf_counter_ns
    for module, path, label in (*CHECKPOINTS, *extra):
        owner, name, fn = resolve(module, path)
        enter, leave = label + ">", label + "<"
        wrapped: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):
            async def wrapped_async(*args: Any, _fn: Any = fn, _in: str = enter,
                                    _out: str = leave, **kwargs: Any) -> Any:
                log.append((_in, clock()))
                try:
                    return await _fn(*args, **kwargs)
                finally:
                    log.append((_out, clock()))
            wrapped = wrapped_async
        else:
            def wrapped_sync(*args: Any, _fn: Any = fn, _in: str = enter, _out: str = leave,
                             **kwargs: Any) -> Any:
                log.append((_in, clock()))
                try:
                    return _fn(*args, **kwargs)
                finally:
                    log.append((_out, clock()))
            wrapped = wrapped_sync
        setattr(owner, name, functools.wraps(fn)(wrapped))


def spans(log: Sequence[tuple[str, int]], skip_share: float = 0.2
          ) -> tuple[list[tuple[str, float]], float, int]:
    """From a checkpoint log of sequential requests (each starts at the first checkpoint's
    ``>``): the median microseconds between each two consecutive checkpoints, in the order
    of the first request kept, the median microseconds from a request's first checkpoint to
    its last, and how many requests were kept: those that passed every checkpoint (not the
    health checks), less the first ``skip_share`` of them (warm-up)."""
    first = CHECKPOINTS[0][2] + ">"
    every = {label + ">" for _, _, label in CHECKPOINTS}
    requests: list[list[tuple[str, int]]] = []
    for entry in log:
        if entry[0] == first or not requests:
            requests.append([])
        requests[-1].append(entry)
    routed = [r for r in requests if every <= {label for label, _ in r}]
    kept = routed[int(len(routed) * skip_share):]
    if not kept:
        return [], 0.0, 0
    by_span: dict[str, list[float]] = {}
    order: list[str] = []
    for request in kept:
        for (a, ta), (b, tb) in itertools.pairwise(request):
            key = f"{a} -> {b}"
            if key not in by_span:
                by_span[key] = []
                order.append(key)
            by_span[key].append((tb - ta) / 1e3)
    total = statistics.median((r[-1][1] - r[0][1]) / 1e3 for r in kept)
    return [(key, statistics.median(by_span[key])) for key in order], total, len(kept)


def _requests(n: int) -> list[bytes]:
    """``n`` chat requests as they go on the wire: ``bench_overhead``'s bodies (one of its
    system prompts and a unique question each)."""
    bodies, _ = bodies_for(OverheadConfig(requests=n))
    return [b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body for body in bodies]


def _exchange(sock: socket.socket, request: bytes, buffered: bytes) -> bytes:
    """Send one request and read its whole answer; the bytes read past it."""
    sock.sendall(request)
    while b"\r\n\r\n" not in buffered:
        buffered += sock.recv(65536)
    head, _, rest = buffered.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the gateway answered {head[:80]!r}")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += sock.recv(65536)
    return rest[length:]


def checkpoint(spec: str) -> tuple[str, str, str]:
    """``MODULE:ATTRIBUTE[:LABEL]`` (``gateway.pool:WorkerPool.snapshot:snapshot``) as a
    checkpoint; the label defaults to the attribute."""
    module, _, rest = spec.partition(":")
    path, _, label = rest.partition(":")
    if not module or not path:
        raise ValueError(f"a checkpoint is MODULE:ATTRIBUTE[:LABEL], not {spec!r}")
    return module, path, label or path


async def measure(requests: int, gateway_args: Sequence[str], logs: Path,
                  extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run the workers and the timed gateway (with the checkpoints of :data:`CHECKPOINTS`
    and ``extra``, each ``MODULE:ATTRIBUTE[:LABEL]``), send ``requests`` sequential
    requests, and return the spans (:func:`spans`) and the gateway's CPU per request."""
    base = free_port_block(WORKERS + 1)
    urls = [f"http://{HOST}:{base + i}" for i in range(WORKERS)]
    procs: list[asyncio.subprocess.Process] = []
    log_path = logs / "checkpoints.log"
    try:
        for i, url in enumerate(urls):
            await start_server([sys.executable, "-m", "worker", "--host", HOST, "--port",
                                str(base + i), "--model", MODEL, *ZERO_COST_WORKER_ARGS],
                               url, logs / f"worker-{i}.log", procs)
        port = base + WORKERS
        cmd = [sys.executable, "-m", "loadtest.phases", "--serve", str(log_path),
               *(f"--checkpoint={spec}" for spec in extra), "--",
               "--host", HOST, "--port", str(port), "--access-log", "off", *gateway_args]
        for url in urls:
            cmd += ["--worker", url]
        await start_server(cmd, f"http://{HOST}:{port}", logs / "gateway.log", procs)
        gateway = procs[-1]
        wire = _requests(requests)

        def drive() -> float:
            with socket.create_connection((HOST, port)) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buffered = b""
                before = proc_tree_cpu_s(gateway.pid)
                for request in wire:
                    buffered = _exchange(sock, request, buffered)
                return (proc_tree_cpu_s(gateway.pid) - before) / len(wire)

        cpu = await asyncio.to_thread(drive)
    finally:
        await stop_processes(procs, grace_s=10.0)
    log = [(label, int(ns)) for label, ns in
           (line.rsplit(" ", 1) for line in log_path.read_text().splitlines())]
    table, total, kept = spans(log)
    return {"requests": kept, "spans_us": table, "first_to_last_us": total,
            "gateway_cpu_ms_per_request": cpu * 1e3}


def serve(log_path: str, argv: list[str], extra: Sequence[str] = ()) -> int:
    """The gateway with the checkpoints installed; the log written when it exits."""
    log: list[tuple[str, int]] = []
    install(log, [checkpoint(spec) for spec in extra])
    from gateway.__main__ import main

    try:
        return main(argv)
    finally:
        Path(log_path).write_text("".join(f"{label} {ns}\n" for label, ns in log))


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['requests']} requests (after the warm-up), median us between checkpoints:",
             ""]
    lines += [f"  {key:48s} {us:9.1f}" for key, us in result["spans_us"]]
    lines += ["", f"  first checkpoint to last: {result['first_to_last_us']:.1f} us; gateway CPU "
              f"{result['gateway_cpu_ms_per_request']:.3f} ms per request"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--serve"]:
        rest = args[2:]
        extra = [a.removeprefix("--checkpoint=") for a in rest if a.startswith("--checkpoint=")]
        rest = rest[len(extra):]
        return serve(args[1], rest[1:] if rest[:1] == ["--"] else rest, extra)
    p = argparse.ArgumentParser(prog="python -m loadtest.phases", description=__doc__)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="one more argument for the gateway (repeat; e.g. --gateway-arg=--policy"
                        " --gateway-arg=round_robin)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="MODULE:ATTR[:LABEL]",
                   help="one more function to time (repeat; e.g. --checkpoint="
                        "gateway.pool:WorkerPool.snapshot:snapshot); requests that skip it "
                        "still count")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(args)
    for spec in a.checkpoint:
        checkpoint(spec)  # a malformed one is refused before anything starts
    with tempfile.TemporaryDirectory(prefix="phases-") as tmp:
        result = asyncio.run(measure(a.requests, a.gateway_arg, Path(tmp), a.checkpoint))
    print(json.dumps(result, indent=2) if a.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
