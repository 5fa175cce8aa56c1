"""The live load test's measuring pieces: SSE scanning, the tally, the summary and the report."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.report import RunReport, summarize, to_markdown, write_report
from loadtest.samples import AffinityTally, Sample, StreamScan, read_samples


def sample(t: float, worker: str, inp: int, matched: int, ok: bool = True,
           ttft: float | None = 10.0) -> Sample:
    return Sample(t=t, ok=ok, status=200 if ok else 503, worker=worker, input_tokens=inp,
                  matched_tokens=matched, ttft_ms=ttft, latency_ms=20.0,
                  error="" if ok else "HTTP 503: busy")


def sse(*events: dict[str, object]) -> list[str]:
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def test_stream_scan_stamps_the_first_token_not_the_role_chunk() -> None:
    scan = StreamScan()
    chunks = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "hello"}}]},
        {"choices": [{"index": 0, "delta": {"content": " world"}}]},
        {"choices": [], "usage": {"prompt_tokens": 100,
                                  "prompt_tokens_details": {"cached_tokens": 64}}},
    )
    firsts = [scan.feed(c) for c in chunks]
    assert firsts == [False, True, False, False, False]
    assert scan.done
    assert not scan.error
    assert (scan.prompt_tokens, scan.cached_tokens) == (100, 64)


def test_stream_scan_handles_completions_split_lines_and_errors() -> None:
    scan = StreamScan()
    line = 'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
    assert not scan.feed(line[:10])
    assert scan.feed(line[10:])
    scan.feed('data: {"error": {"message": "the worker broke off"}}\n\n')
    assert scan.error == "the worker broke off"
    assert not scan.done


def test_tally_rows_and_merge() -> None:
    tally = AffinityTally()
    for s in (sample(0, "a", 100, 50), sample(1, "a", 100, 100), sample(1, "b", 200, 0),
              sample(2, "b", 0, 0, ok=False)):
        tally.add(s)
    rows = {r["name"]: r for r in tally.rows()}
    assert rows["a"]["hit_rate"] == "75.0%"
    assert rows["b"]["errors"] == 1
    assert rows["total"]["requests"] == 4
    assert rows["total"]["hit_rate"] == "37.5%"
    assert "hit rate 37.5%" in tally.line()
    master = AffinityTally()
    master.merge(tally.export())
    master.merge(tally.export())
    assert master.total().matched_tokens == 300
    assert master.total().requests == 8


def test_summary_numbers_and_timeline() -> None:
    samples = [sample(0.5, "a", 100, 0, ttft=5.0), sample(1.5, "b", 100, 100, ttft=15.0),
               sample(2.5, "a", 200, 100, ttft=25.0), sample(3.0, "", 0, 0, ok=False)]
    r = summarize("cache_aware", "chat", samples, duration_s=4.0, workers=["a", "b", "c"],
                  bucket_s=2.0)
    assert (r.requests, r.ok, r.errors) == (4, 3, 1)
    assert r.error_kinds == {"HTTP 503": 1}
    assert r.hit_rate == 200 / 400
    assert r.rps == 3 / 4.0
    assert r.ttft_p50_ms == 15.0
    assert r.ttft_p99_ms == 25.0
    assert {w: s.requests for w, s in r.per_worker.items()} == {"a": 2, "b": 1, "c": 0}
    assert r.per_worker["a"].hit_rate == 100 / 300
    assert r.max_over_mean == 2 / 1
    assert [(p.t, p.hit_rate, p.window_hit_rate) for p in r.timeline] == [
        (2.0, 0.5, 0.5), (4.0, 0.5, 0.5)]


def test_report_files(tmp_path: Path) -> None:
    samples = [sample(i / 4, "w1" if i % 2 else "w2", 100, 50 * (i % 3)) for i in range(20)]
    lines = [s.to_json() for s in samples] + ['{"t": 1, "ok"']  # a torn last line is skipped
    assert read_samples(lines) == samples
    report = RunReport(command="python -m loadtest run", config={"workload": "chat"})
    report.results = [summarize(p, "chat", samples, 5.0) for p in ("round_robin", "cache_aware")]
    paths = write_report(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert [r["policy"] for r in data["results"]] == ["round_robin", "cache_aware"]
    for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "rps", "per_worker", "errors",
                "timeline"):
        assert key in data["results"][0]
    for png in ("hit_rate_png", "worker_load_png"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "| round_robin |" in md
    assert "hit_rate.png" in md
    assert to_markdown(report).count("| cache_aware |") == 1


def test_stream_scan_reads_responses_api_events() -> None:
    scan = StreamScan()
    created = {"type": "response.created", "response": {"status": "in_progress", "error": None}}
    delta = {"type": "response.output_text.delta", "delta": "a"}
    done = {"type": "response.completed", "response": {"status": "completed", "usage": {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
        "output_tokens": 2, "total_tokens": 42}}}
    assert not scan.feed(f"event: response.created\ndata: {json.dumps(created)}\n\n")
    assert scan.feed(f"event: response.output_text.delta\ndata: {json.dumps(delta)}\n\n")
    assert not scan.feed(f"data: {json.dumps(delta)}\n\n")  # the first token was the one before
    assert not scan.done
    scan.feed(f"event: response.completed\ndata: {json.dumps(done)}\n\n")
    scan.close()
    assert scan.done
    assert (scan.prompt_tokens, scan.cached_tokens) == (40, 32)
    assert not scan.error
    failed = StreamScan()
    failed.feed('data: {"type": "response.failed", "response": {"error": {"code": "x"}}}\n')
    assert failed.error
