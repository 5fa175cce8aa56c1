from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loadtest.cpu_pin import own_core, process_tree

CPUS = os.sched_getaffinity(0)

# A child that starts a grandchild and a thread of its own, then waits.
_PARENT = ("import subprocess, sys, threading, time\n"
           "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
           "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
           "print(g.pid, flush=True)\ntime.sleep(60)\n")


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_process_tree_holds_the_process_and_its_descendants() -> None:
    child = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert set(process_tree(child.pid)) == {child.pid, grandchild}
        assert {child.pid, grandchild} <= set(process_tree(os.getpid()))
        assert process_tree(2**22 + 12345) == [2**22 + 12345]  # only itself, found nowhere
    finally:
        subprocess.run(["pkill", "-P", str(child.pid)], check=False)
        child.kill()
        child.wait()


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_own_core_pins_each_router_tree_to_one_cpu_and_the_rest_to_the_others() -> None:
    first = min(CPUS)
    router = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE,
                              text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert router.stdout is not None
        grandchild = int(router.stdout.readline())
        with own_core([router.pid]) as pinned:
            assert pinned
            # Every thread of the router and of its child, the router's thread included.
            for pid in (router.pid, grandchild):
                assert _affinities(pid) == [{first}] * len(_affinities(pid))
            assert len(_affinities(router.pid)) >= 2
            assert _affinities(other.pid) == [CPUS - {first}]
            assert os.sched_getaffinity(0) == CPUS - {first}
        for pid in (router.pid, grandchild, other.pid, os.getpid()):
            assert all(cpus == CPUS for cpus in _affinities(pid))
    finally:
        subprocess.run(["pkill", "-P", str(router.pid)], check=False)
        for proc in (router, other):
            proc.kill()
            proc.wait()
