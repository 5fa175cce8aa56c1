"""Reading a worker's ``/metrics`` page: the engine gauges and counters the gateway routes by.

A vLLM page is a few hundred lines (every histogram's buckets, per model and per data-parallel
engine) of which the gateway wants about ten, and the health loop reads one page per worker
each interval on the event loop that relays requests. So the page is never walked position by
position: each search starts from a literal (``vllm:``, ``engine="``, the cache-info name),
which the regular-expression engine finds with a fast substring scan, and whether a hit starts
a line (a sample, not a mention in a ``# HELP`` line) or a label is checked at the hit alone.
Anchored patterns (``^`` in multi-line mode) would be tried at every byte of the page; on the
reference worker's 11 KB page that was 0.24 ms a probe, most of it looking for an ``engine``
label the page does not have.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

from gateway.backends.base import CACHE_CAPACITY_TOKENS, ENGINE_RANKS
from gateway.contracts import engine_metrics as metric

ENGINE_METRICS = (
    metric.RUNNING,
    metric.WAITING,
    metric.KV_CACHE_USAGE,
    metric.total(metric.PREFIX_CACHE_QUERIES),
    metric.total(metric.PREFIX_CACHE_HITS),
    metric.QUEUE_TIME_SUM,
    metric.QUEUE_TIME_COUNT,
    metric.FIRST_TOKEN_TIME_SUM,
    metric.FIRST_TOKEN_TIME_COUNT,
)
# A sample of one of ENGINE_METRICS: name, labels, value (the name whole: followed by its
# labels or by white space). Matched from its name on; whether it starts a line is checked
# apart (``_at_line_start``).
_SAMPLE = re.compile(
    "(" + "|".join(sorted(map(re.escape, ENGINE_METRICS), key=len, reverse=True)) + ")"
    r"(?:\{([^}]*)\})?\s+([-+0-9.eEinfINFaN]+)$",
    re.MULTILINE)
_CACHE_INFO = re.compile(re.escape(metric.CACHE_CONFIG_INFO) + r"\{(?P<labels>[^}]*)\}")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# vLLM's label of the data-parallel engine a series belongs to; a label only when it opens the
# label set or follows a comma (white space between allowed), not the end of another name.
_ENGINE = re.compile(r'engine="([^"]*)"')


def _at_line_start(text: str, at: int) -> bool:
    return at == 0 or text[at - 1] == "\n"


def _engines(text: str) -> Iterator[str]:
    """The values of every ``engine`` label in ``text`` (a page or one label set)."""
    for found in _ENGINE.finditer(text):
        at = found.start() - 1
        while at >= 0 and text[at].isspace():
            at -= 1
        if at < 0 or text[at] in "{,":
            yield found.group(1)


def _engine_values(text: str) -> set[str]:
    """The distinct values of the ``engine`` labels of a page. The literal's values (one pass
    in C) are a superset (they include a ``myengine`` label's); each is confirmed by a label
    written as vLLM writes it (``{engine="0"`` or ``,engine="0"``), and only a value that is
    not written so is looked for label by label."""
    found = set()
    for value in set(_ENGINE.findall(text)):
        label = f'engine="{value}"'
        if ("{" + label in text or "," + label in text
                or any(v == value for v in _engines(text))):
            found.add(value)
    return found


def _engine_of(labels: str) -> str | None:
    return next(_engines(labels), None)


def parse_engine_metrics(text: str, rank: int | None = None) -> dict[str, float]:
    """Sum each of :data:`ENGINE_METRICS` over its label sets in a Prometheus text page, and
    the KV cache capacity (``num_gpu_blocks x block_size`` of ``vllm:cache_config_info``) as
    :data:`~gateway.backends.base.CACHE_CAPACITY_TOKENS`. A sample that is not a finite
    number is left out (one engine's ``NaN`` or ``+Inf`` must not reach the pool's load, nor
    an infinite cache size the health round, which converts it to blocks).

    With ``rank``, only the series of that data-parallel engine (vLLM's label ``engine``)
    count; a page whose series carry no ``engine`` label speaks for every rank alike. Without,
    a page of several engines says how many in :data:`~gateway.backends.base.ENGINE_RANKS`."""
    out: dict[str, float] = {}
    labelled = 'engine="' in text and _engine_of(text) is not None
    want = str(rank) if rank is not None and labelled else None
    if rank is None and labelled:
        engines = _engine_values(text)
        if len(engines) > 1:
            out[ENGINE_RANKS] = float(len(engines))
    for found in _SAMPLE.finditer(text):
        if not _at_line_start(text, found.start()):
            continue  # a mention (``# HELP vllm:...``), not a sample
        name, labels, value = found.groups()
        if want is not None and _engine_of(labels or "") != want:
            continue
        try:
            sample = float(value)
        except ValueError:
            continue
        if math.isfinite(sample):  # a NaN or an infinity would poison the load's sums
            out[name] = out.get(name, 0.0) + sample
    # vLLM labels each engine's cache geometry; one without the label is every rank's.
    for found in _CACHE_INFO.finditer(text):
        if _at_line_start(text, found.start()) and (
                want is None or _engine_of(found.group("labels")) in (want, None)):
            labels = dict(_LABEL.findall(found.group("labels")))
            try:
                capacity = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
            except (KeyError, ValueError):
                capacity = 0.0
            if 0 < capacity < math.inf:  # an infinite size cannot be modelled in blocks
                out[CACHE_CAPACITY_TOKENS] = capacity
            break
    return out
