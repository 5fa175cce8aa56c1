"""The fault catalogue's figures: recovery time and dropped in-flight requests from samples."""

from __future__ import annotations

from loadtest.chaos import (
    ChaosConfig,
    FaultResult,
    config_from,
    dropped_in_flight,
    failure_notes,
    parse_args,
    recover_seconds,
    to_markdown,
)
from loadtest.chaos_load import Sample


def _ok(start: float, end: float) -> Sample:
    return Sample(start, end, stream=False, ok=True)


def test_recovery_ends_with_the_last_failed_or_slow_request() -> None:
    before = [_ok(t, t + 0.1) for t in range(10)]
    after = [
        Sample(10.5, 10.6, stream=False, ok=False),
        _ok(11.0, 13.5),  # slower than max(1 s, 5 x the 0.1 s median): disturbed
        _ok(14.0, 14.1),
    ]
    assert recover_seconds(before + after, fault_at=10.0) == 3.5


def test_no_disturbance_means_zero_recovery() -> None:
    samples = [_ok(t, t + 0.1) for t in range(20)]
    assert recover_seconds(samples, fault_at=10.0) == 0.0


def test_dropped_counts_only_failures_in_flight_at_the_signal() -> None:
    samples = [
        Sample(9.0, 10.5, stream=True, ok=False),  # in flight at 10, failed: dropped
        Sample(9.5, 10.2, stream=False, ok=True),  # in flight, finished: fine
        Sample(10.1, 10.2, stream=False, ok=False),  # sent after the signal: not in flight
    ]
    assert dropped_in_flight(samples, at=10.0) == 1


def test_markdown_table_has_one_row_per_fault_and_the_command() -> None:
    rows = [FaultResult("worker kill -9", sent=10, failed=0, failed_streams=1, retried=2,
                        recover_s=0.5),
            FaultResult("500 clients abort", sent=5, aborted_tokens_after_1s=0)]
    text = to_markdown(rows, ChaosConfig(), "python -m loadtest chaos")
    assert text.startswith("`python -m loadtest chaos`")
    assert "| worker kill -9 | 10 | 0 | 1 | 2 | 0.50 |  |  |  |" in text
    assert "| 500 clients abort | 5 | 0 | 0 | 0 | 0.00 |  | 0 |  |" in text


def test_failure_notes_count_what_the_failed_requests_saw() -> None:
    samples = [
        Sample(1.0, 2.0, stream=False, ok=False, error="HTTP 503"),
        Sample(1.0, 2.0, stream=True, ok=False, error="HTTP 503"),
        Sample(1.0, 2.0, stream=True, ok=False, error="stream error event"),
        _ok(1.0, 2.0),
    ]
    assert failure_notes(samples) == ["failures: HTTP 503 x2, stream error event x1"]
    assert failure_notes([_ok(1.0, 2.0)]) == []


def test_extra_process_flags_are_split_like_a_shell_line_and_shown() -> None:
    args = parse_args(["--gateway-args=--max-inflight 64", "--gateway-args", "--max-queue 512",
                       "--worker-args=--max-running 16"])
    config = config_from(args)
    assert config.gateway_args == ("--max-inflight", "64", "--max-queue", "512")
    text = to_markdown([], config, "cmd")
    assert "--max-inflight 64 --max-queue 512`" in text
    assert "workers with `--max-running 16`" in text
