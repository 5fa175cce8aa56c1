"""A router alone on one core for a measurement, the client and the workers on the others.

On a machine where the client, the workers and the router share every core, the kernel wakes
a socket's reader on the core of the process that wrote to it (the write carries the hint
that the writer is about to sleep). A Rust router's thread does sleep after its write; an
event loop goes on with the request's bookkeeping, on the core where the worker it has just
woken now waits or preempts it, while another core may idle. Part of its work after the write
can then land on the request's path at one request in flight, which it cannot where the router
has cores of its own, as any deployment gives it (the engines run on their own hosts).
:func:`own_core` pins each router (every thread of its process and of its descendants) to one
core and everything else this process started to the other cores, for the length of a
measurement; it is a benchmark's setting, never the gateway's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator


def _children() -> dict[int, list[int]]:
    """Every live process's children, from ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        # The fields after the command name, which is in parentheses and may hold spaces.
        ppid = int(raw[raw.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children = _children()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of each of ``pids`` (and of their descendants) to ``cpus``; a process or
    thread that has exited meanwhile is skipped."""
    for root in pids:
        for pid in process_tree(root):
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def own_core(routers: Iterable[int]) -> Iterator[bool]:
    """Each of ``routers`` (process ids) on the first of this process's CPUs, this process and
    everything else it started on the rest; all of them back on every CPU afterwards. Yields
    False (and pins nothing) with fewer than two CPUs."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        yield False
        return
    first = min(cpus)
    try:
        pin([os.getpid()], cpus - {first})
        pin(routers, {first})
        yield True
    finally:
        pin([os.getpid()], cpus)
