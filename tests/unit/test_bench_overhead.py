from __future__ import annotations

import os

from loadtest.bench_overhead import proc_tree_cpu_s, top_functions


def test_top_functions_counts_own_and_inclusive_samples() -> None:
    collapsed = "main;handle;parse 6\nmain;handle;route 3\nmain;idle 1\nnot a stack line\n"
    top = top_functions(collapsed, count=2)
    assert top == [("parse", 0.6, 0.6), ("route", 0.3, 0.3)]
    assert top_functions("") == []


def test_proc_tree_cpu_grows_with_work() -> None:
    before = proc_tree_cpu_s(os.getpid())
    deadline = before + 0.05
    while proc_tree_cpu_s(os.getpid()) < deadline:
        sum(range(10_000))
    assert proc_tree_cpu_s(os.getpid()) >= deadline
    assert proc_tree_cpu_s(2**22 + 12345) == 0.0  # no such process
