"""Reading a worker's /metrics page (gateway.backends.metrics_page) against a line-by-line
reading of the same page: vLLM-shaped pages with histograms, data-parallel engines, mentions
of the names in # HELP lines and label sets that only look like an engine's."""

from __future__ import annotations

import math
import random
import re

import pytest

from gateway.backends.base import CACHE_CAPACITY_TOKENS, ENGINE_RANKS
from gateway.backends.metrics_page import ENGINE_METRICS, parse_engine_metrics

_PAIR = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def _labels(text: str) -> dict[str, str]:
    return dict(_PAIR.findall(text))


def read_by_lines(page: str, rank: int | None) -> dict[str, float]:
    """The page read one line at a time: ``name{labels} value`` samples, comments skipped."""
    samples: list[tuple[str, dict[str, str], str]] = []
    for line in page.split("\n"):
        if not line.startswith("vllm:"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, label_text = head.strip().partition("{")
        samples.append((name, _labels(label_text.rstrip("}")), value))
    engines = {labels["engine"] for _, labels, _ in samples if "engine" in labels}
    want = str(rank) if rank is not None and engines else None
    out: dict[str, float] = {}
    if rank is None and len(engines) > 1:
        out[ENGINE_RANKS] = float(len(engines))
    for name, labels, value in samples:
        allowed: tuple[str | None, ...] = (
            (want,) if name != "vllm:cache_config_info" else (want, None))
        if want is not None and labels.get("engine") not in allowed:
            continue
        if name == "vllm:cache_config_info":
            if CACHE_CAPACITY_TOKENS in out or "seen-info" in out:
                continue
            out["seen-info"] = 0.0
            try:
                size = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
            except (KeyError, ValueError):
                continue
            if 0 < size < math.inf:
                out[CACHE_CAPACITY_TOKENS] = size
        elif name in ENGINE_METRICS and math.isfinite(number := float(value)):
            out[name] = out.get(name, 0.0) + number
    out.pop("seen-info", None)
    return out


def vllm_page(rng: random.Random, engines: list[str | None], histograms: int) -> str:
    lines = []
    names = [*ENGINE_METRICS, "vllm:prompt_tokens_total", "vllm:num_requests_running_max"]
    for engine in engines:
        labels = (f'model_name="m",engine="{engine}"' if engine is not None
                  else 'model_name="m"')
        for name in names:
            lines.append(f"# HELP {name} about {name} {rng.randint(0, 9)}")
            value = rng.choice(["1.0", "2.5", "0", "3e2", "NaN", "+Inf", "7"])
            lines.append(f"{name}{{{labels}}} {value}")
        blocks = rng.choice(["128", "4096", "inf", "x"])
        lines.append(f'vllm:cache_config_info{{block_size="16",{labels},'
                     f'num_gpu_blocks="{blocks}"}} 1.0')
        for h in range(histograms):
            lines += [f'vllm:h{h}_seconds_bucket{{{labels},le="{b / 10}"}} {b}' for b in range(20)]
    rng.shuffle(lines)
    return "\n".join(lines) + "\n"


def test_a_page_reads_as_it_does_line_by_line() -> None:
    rng = random.Random(7)
    pages = 0
    for _ in range(200):
        choices: list[list[str | None]] = [[None], ["0"], ["0", "1"], ["0", "1", "2", "3"],
                                           ["1", None]]
        engines = rng.choice(choices)
        page = vllm_page(rng, engines, rng.randint(0, 3))
        if rng.random() < 0.3:
            page = page.replace(",engine", ", engine")
        if rng.random() < 0.3:
            page = page.replace('model_name="m",engine', 'model_name="m",myengine', 1)
        if rng.random() < 0.3:
            page = "vllm:num_requests_waiting 4\nxvllm:num_requests_running 9\n" + page
        for rank in (None, 0, 1, 3):
            assert parse_engine_metrics(page, rank) == read_by_lines(page, rank), (page, rank)
        pages += 1
    assert pages == 200


@pytest.mark.parametrize("mention", [
    "# HELP vllm:num_requests_running 12",  # a comment that ends like a sample
    "# TYPE vllm:num_requests_running gauge",
    'xvllm:num_requests_running{model_name="m"} 4',  # another metric's name
    'vllm:num_requests_running_max{model_name="m"} 4',
])
def test_a_mention_of_a_name_is_not_a_sample(mention: str) -> None:
    page = f'{mention}\nvllm:num_requests_running{{model_name="m"}} 3\n'
    assert parse_engine_metrics(page) == {"vllm:num_requests_running": 3.0}


def test_only_a_label_named_engine_is_an_engine() -> None:
    page = ('vllm:num_requests_running{myengine="0"} 3\n'
            'vllm:num_requests_running{myengine="1"} 4\n')
    assert parse_engine_metrics(page) == {"vllm:num_requests_running": 7.0}
    assert parse_engine_metrics(page, 1) == {"vllm:num_requests_running": 7.0}
    spaced = ('vllm:num_requests_running{model_name="m", engine="0"} 3\n'
              'vllm:num_requests_running{ engine="1"} 4\n')
    assert parse_engine_metrics(spaced, 1) == {"vllm:num_requests_running": 4.0}
    assert parse_engine_metrics(spaced)[ENGINE_RANKS] == 2.0
