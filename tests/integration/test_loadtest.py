"""Live load tests end to end: ``python -m loadtest run`` starts workers and a gateway per
policy, runs locust headless against them (streaming) and writes the report.

Short runs with few users; the assertions are about behaviour (the report's fields, no errors,
affinity beating round-robin on a chat workload), never about timings.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import StartCluster

REPORT_FIELDS = (
    "policy", "workload", "requests", "ok", "errors", "error_kinds", "rps", "hit_rate",
    "input_tokens", "matched_tokens", "ttft_p50_ms", "ttft_p99_ms", "per_worker",
    "max_over_mean", "timeline",
)


def _check_result(result: dict[str, Any]) -> None:
    for key in REPORT_FIELDS:
        assert key in result, key
    assert result["ok"] > 0
    assert result["errors"] == 0, result["error_kinds"]
    assert result["input_tokens"] > 0
    assert 0.0 <= result["hit_rate"] <= 1.0
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert result["rps"] > 0
    assert result["timeline"]
    shares = [w["share"] for w in result["per_worker"].values()]
    assert abs(sum(shares) - 1.0) < 1e-9


def _run_loadtest(args: list[str], logs: Path, timeout_s: float) -> tuple[int, str, str]:
    """``python -m loadtest ARGS`` in its own process group, output to files. On a timeout the
    whole group (its workers, gateway and locust too) is killed and the test fails with the
    output so far: with pipes, a child still holding them would make the wait endless."""
    out_path, err_path = logs / "stdout.txt", logs / "stderr.txt"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "loadtest", *args], stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -1
    stdout = out_path.read_text(encoding="utf-8", errors="replace")
    stderr = err_path.read_text(encoding="utf-8", errors="replace")
    assert code != -1, f"loadtest did not finish in {timeout_s:g} s:\n{stderr[-3000:]}"
    return code, stdout, stderr


def test_headless_run_reports_and_affinity_beats_round_robin(tmp_path: Path) -> None:
    out = tmp_path / "report"
    code, stdout, stderr = _run_loadtest(
        ["run", "--workload", "chat", "--policy", "round_robin,cache_aware", "--workers", "4",
         "--duration", "5", "--users", "8", "--out", str(out)],
        tmp_path, timeout_s=180,
    )
    assert code == 0, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    results = {r["policy"]: r for r in report["results"]}
    assert list(results) == ["round_robin", "cache_aware"]
    for result in results.values():
        _check_result(result)
        assert len(result["per_worker"]) == 4
    assert results["cache_aware"]["hit_rate"] > results["round_robin"]["hit_rate"]
    # round-robin spreads evenly by construction
    assert results["round_robin"]["max_over_mean"] < 1.2
    markdown = (out / "report.md").read_text()
    assert "| round_robin |" in markdown
    assert "| cache_aware |" in markdown
    assert markdown == stdout
    for png in ("hit_rate.png", "worker_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # locust's own outputs and the raw samples are kept per policy
    for policy in results:
        assert (out / policy / "locust_stats.csv").exists()
        assert (out / policy / "samples.jsonl").stat().st_size > 0
        log = (out / policy / "locust.log").read_text()
        assert "cache affinity (worker-reported matched / input tokens)" in log


async def _against(gateway_url: str, out: Path, logs: Path,
                   *args: str) -> tuple[dict[str, Any], str]:
    """``python -m loadtest run --gateway URL`` for 3 s with 4 users and ``args``: the one
    result of its report, and its stdout. In a thread: the gateway under test runs on this
    event loop."""
    code, stdout, stderr = await asyncio.to_thread(
        _run_loadtest,
        ["run", "--gateway", gateway_url, "--duration", "3", "--users", "4", "--no-plots",
         "--out", str(out), *args],
        logs, 120,
    )
    assert code == 0, stderr[-3000:]
    [result] = json.loads((out / "report.json").read_text())["results"]
    _check_result(result)
    return result, stdout


async def test_trace_replay_against_a_running_gateway(
    start_cluster: StartCluster, tmp_path: Path
) -> None:
    cluster = await start_cluster(workers=2)
    result, stdout = await _against(
        cluster.gateway_url, tmp_path / "report", tmp_path, "--workload", "mooncake",
        "--locust-arg=--block-chars=64", "--locust-arg=--max-blocks=12")
    assert result["policy"] == "cache_aware"  # the policy the running gateway reports
    assert result["workload"] == "mooncake"
    assert set(result["per_worker"]) == {u.removeprefix("http://") for u in cluster.worker_urls}
    # every request of the conversation trace starts with the same block: prefixes are shared
    assert result["hit_rate"] > 0
    assert result["gateway_hit_rate"] is not None
    assert "| cache_aware |" in stdout


async def test_a_workload_over_the_responses_api(
    start_cluster: StartCluster, tmp_path: Path
) -> None:
    cluster = await start_cluster(workers=2)
    out = tmp_path / "report"
    # Streamed Responses events: TTFT from the first text delta, the usage (and its cached
    # tokens) from the completed response, every stream ended by it (_check_result).
    result, _ = await _against(cluster.gateway_url, out, tmp_path, "--workload", "chat",
                               "--locust-arg=--api=responses")
    assert result["hit_rate"] > 0  # multi-turn chats: each turn extends the last
    samples = [json.loads(line) for line in
               (out / "cache_aware" / "samples.jsonl").read_text().splitlines()]
    assert samples
    assert all("(responses)" in s["label"] for s in samples)
