"""The guidellm benchmark's pieces that run without guidellm: tokenizer, command, result."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.guidellm_bench import build_tokenizer, guidellm_command, read_result
from worker.tokenizer import HFTokenizer


def test_tokenizer_is_deterministic_and_loads_in_the_worker(tmp_path: Path) -> None:
    a = build_tokenizer(tmp_path / "a")
    b = build_tokenizer(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    tok = HFTokenizer(str(a))
    ids = tok.encode("the customer asked about the invoice")
    assert 0 < len(ids) < 20
    assert json.loads((a.parent / "tokenizer_config.json").read_text())["tokenizer_class"]


def test_command_and_result(tmp_path: Path) -> None:
    cmd = guidellm_command("guidellm", "http://127.0.0.1:1", tmp_path, 50, tmp_path / "o.json")
    text = " ".join(cmd)
    assert "prefix_tokens=2000,prefix_count=16" in text
    assert "prompt_tokens=200,output_tokens=32" in text
    assert "streams=16" in text
    assert "count=50" in text
    out = tmp_path / "o.json"
    out.write_text(json.dumps({"benchmarks": [{"metrics": {
        "time_to_first_token_ms": {"successful": {"percentiles": {"p50": 50.5, "p95": 99.0}}},
        "requests_per_second": {"successful": {"mean": 37.1}},
        "request_totals": {"successful": 50, "errored": 0},
    }}]}))
    assert read_result(out) == {"ttft_p50_ms": 50.5, "ttft_p95_ms": 99.0,
                                "requests_per_s": 37.1, "completed": 50.0, "errored": 0.0}
