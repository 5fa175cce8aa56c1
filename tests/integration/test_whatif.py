"""``python -m loadtest.whatif`` on a saved replay report: a change simulated against the
gateway as it was, run by run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import whatif
from tests.integration.test_loadtest import _run_loadtest
from tests.integration.test_replay import tiny_trace


def test_whatif_pairs_each_live_run_with_its_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    tiny_trace(trace)
    code, stdout, stderr = _run_loadtest(
        ["replay", "--trace", str(trace), "--workers", "2", "--cache-blocks", "20",
         "--concurrency", "4", "--policy", "cache_aware", "--repeat", "2", "--json"],
        tmp_path, timeout_s=180,
    )
    assert code == 0, stderr[-3000:]
    saved = tmp_path / "report.json"
    saved.write_text(stdout, encoding="utf-8")

    def rows(*sets: str) -> list[dict[str, object]]:
        args = [str(saved), "--draws", "2", "--json"]
        for change in sets:
            args += ["--set", change]
        assert whatif.main(args) == 0
        out: list[dict[str, object]] = json.loads(capsys.readouterr().out)["rows"]
        return out

    # The default value set again changes nothing: both sides run on the same timing and
    # jitter, so every pair is equal, at the draws and at the decision instants.
    (same,) = rows("policy.cache_aware_load_factor=3")
    assert same["workload"] == "trace.jsonl, 2 x 20"
    assert same["runs"] == 2
    assert same["hit_change"] == 0.0
    assert same["hit_change_decided"] == 0.0
    assert same["runs_raised"] == same["runs_lowered"] == 0
    assert same["simulated"] == same["changed"]
    assert same["p99_change_ms"] == 0.0
    # No prefix ever long enough to count as held: every request is placed cold, on the
    # ring choice with the fewest recent requests, so the four prompts go to both workers,
    # whose 20 blocks hold two of them: the change costs hit rate in every run.
    (cold,) = rows("policy.min_match_blocks=100")
    assert isinstance(cold["hit_change"], float)
    assert cold["hit_change"] < 0
    assert cold["runs_lowered"] == 2
    assert cold["simulated"] == same["simulated"]
