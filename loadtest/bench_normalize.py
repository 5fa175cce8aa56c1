"""What a long prompt's text costs the gateway in one process: normalization and fingerprint.

``python -m loadtest.bench_normalize [--chars N] [--runs K] [--json]`` times, on texts of each
layout of :func:`long_text` (``lines``, ``words``, ``ragged``, ``typeset``, ``emoji``, ``cjk``;
also the long prompts of ``loadtest.bench_overhead --long-text``), in ms, medians of
``--runs``:

* ``rules``: :func:`gateway.normalize.normalize_text`, the text seen for the first time;
* ``rules, seen``: the same text again, remembered (:class:`gateway.normalize.NormalTexts`);
* ``fingerprint``: :func:`gateway.fingerprint.fingerprint` of the normalized text.

No I/O, no event loop: the part of a long request's CPU that grows with the text, apart from
JSON decoding (orjson), reading and writing. To compare with another checkout, run this file
(``python loadtest/bench_normalize.py``) with that checkout first on ``PYTHONPATH``; ``rules,
seen`` is left out where it has no :class:`~gateway.normalize.NormalTexts`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from gateway import normalize
from gateway.fingerprint import Namespace, fingerprint
from gateway.settings import GatewaySettings
from loadtest.workloads import words

# The layouts of long prompts' text (long_text), for this bench and bench_overhead's.
LONG_TEXTS = ("lines", "words", "ragged", "typeset", "emoji", "cjk")


def long_text(rng: random.Random, chars: int, layout: str) -> str:
    """``chars`` characters of seeded words: one line (``words``), or lines of 4-16 words, a
    third of them indented (``lines``), and a quarter of them ending in spaces as a
    re-rendered context's do (``ragged``), which the gateway's normalization trims, or with
    a typeset quote or dash in one line of eight (``typeset``: text that is not ASCII, as a
    model's answers and most edited prose are), or an emoji (``emoji``: characters beyond
    the Basic Multilingual Plane); or lines of 10-40 CJK ideographs (``cjk``)."""
    if layout == "words":
        return words(rng, chars // 3 + 1)[:chars]
    if layout not in LONG_TEXTS:
        raise ValueError(f"unknown long text layout {layout!r}; one of {LONG_TEXTS}")
    lines, size = [], 0
    while size < chars:
        if layout == "cjk":
            line = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(10, 40)))
        else:
            line = "    " * (rng.random() < 0.33) + words(rng, rng.randint(4, 16))
        if layout == "ragged" and rng.random() < 0.25:
            line += "  "
        elif layout == "typeset" and rng.random() < 0.125:
            line += rng.choice((" \u2014 it\u2019s so", " \u201cquoted\u201d"))
        elif layout == "emoji" and rng.random() < 0.125:
            line += rng.choice((" \U0001f600", " \U0001f44d", " \U0001f680"))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]


def _median_ms(run: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _row(text: str, runs: int, settings: GatewaySettings) -> dict[str, float]:
    opts, fp_opts = settings.normalize_options(), settings.fingerprint_options()
    namespace = Namespace(tenant="t", model="m", cache_salt="")
    normal = normalize.normalize_text(text, opts)
    row = {"rules": _median_ms(lambda: normalize.normalize_text(text, opts), runs)}
    memo = getattr(normalize, "NormalTexts", None)
    if memo is not None:
        texts = memo()
        normalize.normalize_text(text, opts, texts.scope("t", ""))
        row["rules, seen"] = _median_ms(
            lambda: normalize.normalize_text(text, opts, texts.scope("t", "")), runs)
    row["fingerprint"] = _median_ms(lambda: fingerprint(normal, namespace, fp_opts), runs)
    return row


def measure(chars: int, runs: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Layout -> {part: median ms} for texts of ``chars`` characters."""
    settings = GatewaySettings()
    normalize.normalize_text("\u00e9", settings.normalize_options())  # tables, built once
    return {layout: _row(long_text(random.Random(seed), chars, layout), runs, settings)
            for layout in LONG_TEXTS}


def to_markdown(result: dict[str, dict[str, float]], chars: int) -> str:
    parts = list(next(iter(result.values())))
    lines = [f"Texts of {chars:,} characters, ms (medians):", "",
             "| layout | " + " | ".join(parts) + " |", "|---|" + "---:|" * len(parts)]
    lines += [f"| {layout} | " + " | ".join(f"{row[p]:.3f}" for p in parts) + " |"
              for layout, row in result.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--chars", type=int, default=640_000, help="text length in characters")
    p.add_argument("--runs", type=int, default=15, help="timed runs per part (median)")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = p.parse_args(argv)
    result = measure(args.chars, args.runs)
    print(json.dumps(result, indent=2) if args.json else to_markdown(result, args.chars))


if __name__ == "__main__":
    main()
