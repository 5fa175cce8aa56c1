"""What the prefix index costs per request: recording a decision and matching a prompt.

``python -m loadtest.bench_index [--workers 16] [--cache-blocks 500 4000] [--long 3200 640000]
[--passes 5] [--baseline FILE]``

Two kinds of keys, each replayed through a fresh :class:`~gateway.routing.prefix_index.PrefixIndex`
per pass (the median pass is reported, in microseconds per request):

* ``mooncake``: the Mooncake conversation trace's keys (as the simulator builds them), each
  matched and then recorded for a worker drawn at random (seeded) among ``--workers``, whose
  modelled caches hold ``--cache-blocks`` blocks each: most of a request's blocks are new to
  its worker and as many old ones are evicted, as on the live replay;
* ``long``: 40 prompts of ``--long`` characters each, none seen before, fingerprinted as the
  gateway does (64-character blocks, sparse checkpoints) and recorded for one worker with a
  50,000-block cache;
* ``shared``: ``--shared-workers`` workers (0: left out) with 200-block caches, 20,000
  requests that share one 30-block system prompt and add 20 blocks of their own, each for a
  worker drawn at random: every worker holds the shared prompt, as in a wide fleet.

``--baseline FILE`` measures the ``PrefixIndex`` of another module too, alternating pass by
pass in this process (for example an older revision: ``git show
REV:gateway/routing/prefix_index.py > /tmp/prefix_index_rev.py``), with the ratio of the two.
In process and single-threaded: a benchmark of the index alone, not of the gateway.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.fingerprint import FingerprintOptions, Namespace, PrefixKey, fingerprint
from gateway.routing.prefix_index import PrefixIndex
from loadtest.simulate import DEFAULT_TRACE
from loadtest.traces import read_mooncake

LONG_PROMPTS = 40
LONG_CACHE_BLOCKS = 50_000


def load_index(path: Path) -> Any:
    """The ``PrefixIndex`` class of the module in ``path``."""
    name = f"prefix_index_baseline_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module.PrefixIndex


def one_pass(index_class: Any, keys: Sequence[PrefixKey], workers: Sequence[str],
             capacity: int) -> float:
    """Microseconds per key to match it and record it for its worker, over a fresh index."""
    index = index_class(capacity=capacity)
    spent = 0.0
    clock = time.perf_counter
    for i, (key, worker) in enumerate(zip(keys, workers, strict=True)):
        now = i * 0.05
        started = clock()
        index.match(key.blocks, now)
        index.record(key.blocks, worker, now, key.depths)
        spent += clock() - started
    return spent / len(keys) * 1e6


def mooncake_keys(workers: int, seed: int = 1) -> tuple[list[PrefixKey], list[str]]:
    keys = [r.key for r in read_mooncake(DEFAULT_TRACE)]
    rng = random.Random(seed)
    return keys, [f"w{rng.randrange(workers)}" for _ in keys]


def long_keys(chars: int, seed: int = 3) -> tuple[list[PrefixKey], list[str]]:
    rng = random.Random(seed + chars)
    namespace = Namespace(tenant="bench")
    keys = [fingerprint("".join(rng.choices("abcdefgh ", k=chars)), namespace,
                        FingerprintOptions()) for _ in range(LONG_PROMPTS)]
    return keys, ["w1"] * len(keys)


def shared_keys(workers: int, requests: int = 20_000,
                seed: int = 5) -> tuple[list[PrefixKey], list[str]]:
    rng = random.Random(seed)
    namespace, opts = Namespace(tenant="bench"), FingerprintOptions()
    system = "s" * 30 * 64
    prior = fingerprint(system, namespace, opts)
    keys = [fingerprint(system + f"{i:08d}" * (20 * 64 // 8), namespace, opts, prior)
            for i in range(requests)]
    return keys, [f"w{rng.randrange(workers)}" for _ in keys]


def measure(subjects: Sequence[tuple[str, Any]], keys: Sequence[PrefixKey],
            workers: Sequence[str], capacity: int, passes: int) -> dict[str, float]:
    """Median microseconds per request of each subject, passes alternating between them."""
    times: dict[str, list[float]] = {name: [] for name, _ in subjects}
    for _ in range(passes):
        for name, index_class in subjects:
            times[name].append(one_pass(index_class, keys, workers, capacity))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_index", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, nargs="+", default=[500, 4000])
    p.add_argument("--long", type=int, nargs="*", default=[3_200, 100_000, 640_000],
                   metavar="CHARS")
    p.add_argument("--shared-workers", type=int, default=512, metavar="N")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--baseline", type=Path, metavar="FILE",
                   help="a prefix_index module whose PrefixIndex is measured too")
    args = p.parse_args(argv)
    subjects: list[tuple[str, Any]] = [("this index", PrefixIndex)]
    if args.baseline is not None:
        subjects.append((f"baseline ({args.baseline.name})", load_index(args.baseline)))
    head = "| keys | " + " | ".join(f"{name} us" for name, _ in subjects)
    print(head + (" | ratio |" if len(subjects) > 1 else " |"))
    print("|---|" + "---:|" * (len(subjects) + (len(subjects) > 1)))
    cases: list[tuple[str, tuple[list[PrefixKey], list[str]], int]] = []
    trace = mooncake_keys(args.workers)
    cases += [(f"Mooncake, {args.workers} workers x {c} blocks", trace, c)
              for c in args.cache_blocks]
    for chars in args.long:
        prompts = long_keys(chars)
        checkpoints = len(prompts[0][0].blocks)
        cases.append((f"first-seen {chars:,} characters ({checkpoints} checkpoints)", prompts,
                      LONG_CACHE_BLOCKS))
    if args.shared_workers:
        cases.append((f"{args.shared_workers} workers sharing a 30-block prompt, x 200 blocks",
                      shared_keys(args.shared_workers), 200))
    for label, (keys, workers), capacity in cases:
        us = measure(subjects, keys, workers, capacity, args.passes)
        print_row(label, [f"{us[name]:.1f}" for name, _ in subjects],
                  [us[name] for name, _ in subjects])
    return 0


def print_row(label: str, cells: list[str], values: Sequence[float], digits: int = 2) -> None:
    """One row of a table of subjects side by side (``cells``), with this checkout's value
    over the baseline's (the first two ``values``) when there is a baseline; printed at once."""
    if len(values) > 1:
        cells = [*cells, f"{values[0] / values[1]:.{digits}f}x"]
    print(f"| {label} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
