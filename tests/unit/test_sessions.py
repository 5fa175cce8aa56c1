"""Sessions of a trace and the balance bound of session-sticky routing."""

from __future__ import annotations

import json

import pytest

from loadtest import sessions
from loadtest.traces import TraceRequest, prefix_key


def _req(index: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(index, float(index), 16 * len(ids), 1, prefix_key(ids, 16 * len(ids)))


def test_a_session_is_a_chain_of_prompts_extending_each_other() -> None:
    system = [1, 2, 3]
    trace = [
        _req(0, [*system, 10, 11]),  # session A, turn 1
        _req(1, [*system, 20]),  # a question on the system prompt: its own session
        _req(2, [*system, 10, 11, 12, 13]),  # A, turn 2 (extends turn 1)
        _req(3, [*system, 21]),  # another question: shares only the system prompt
        _req(4, [*system, 10, 11, 12, 13, 14]),  # A, turn 3
        _req(5, [*system, 20]),  # the first question again: the same session
    ]
    assert sessions.session_volumes(trace) == [5 + 7 + 8, 4 + 4, 4]


def test_the_bounds_are_the_largest_session_and_a_largest_first_packing() -> None:
    # Sessions of 12, 3, 3, 3, 3 blocks over 2 workers: mean 12; the largest alone is 1.0,
    # and packing puts 12 on one worker and 3 x 4 on the other.
    trace = [_req(0, list(range(100, 112)))]
    trace += [_req(i, list(range(1000 * i, 1000 * i + 3))) for i in range(1, 5)]
    result = sessions.sticky_balance(trace, 2)
    assert (result.sessions, result.largest_over_mean, result.packed_over_mean) == (5, 1.0, 1.0)
    three = sessions.sticky_balance(trace, 3)  # mean 8: 12 alone is 1.5 x the mean
    assert three.largest_over_mean == pytest.approx(1.5)
    assert three.packed_over_mean == pytest.approx(1.5)
    with pytest.raises(ValueError, match="workers"):
        sessions.sticky_balance(trace, 0)


def test_the_command_reads_a_trace_as_the_replay_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert sessions.main(["--workload", "chat", "--requests", "200", "--workers", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 200
    assert 1 <= out["sessions"] < 200  # conversations of several turns each
    assert out["packed_over_mean"] >= out["largest_over_mean"] > 0


def test_losses_put_a_moved_sessions_prefill_on_the_move() -> None:
    system = [1, 2, 3]
    trace = [
        _req(0, [*system, 10]),  # session A on w0
        _req(1, [*system, 20]),  # session B on w1
        _req(2, [*system, 10, 11]),  # A again on w0: hits its whole history
        _req(3, [*system, 20, 21]),  # B moved to w0: redoes its history there
        _req(4, [*system, 20, 21, 22]),  # B stays on w0 now
    ]
    routed = ["w0", "w1", "w0", "w0", "w0"]
    reasons = ["cold -> ring", "cold -> ring", "prefix_hit depth=4",
               "diverted: w1 volume_guard (depth=4) -> volume: least recent volume",
               "prefix_hit depth=6"]
    result = sessions.run_losses(trace, routed, reasons, workers=2, cache_blocks=100,
                                 router="ours", live_hit_over_bound=0.5)
    # The pooled cache hits 0, 3, 4, 4, 5 blocks; the workers' caches 0, 0, 4, 3, 5: the
    # move loses B's own block (20), and w1 redid the system prompt on B's first request.
    assert result.moves == 1
    assert result.replayed_hit_over_bound == pytest.approx(12 / 16)
    assert result.lost_on_moves == pytest.approx(1 / 16)
    assert result.lost_staying == pytest.approx(3 / 16)
    assert result.lost_by_kind == {"cold": pytest.approx(3 / 16),
                                   "diverted:volume_guard": pytest.approx(1 / 16)}
    assert (result.router, result.live_hit_over_bound) == ("ours", 0.5)
    # Everything on one worker with room loses nothing, and no reasons give one kind, "".
    whole = sessions.run_losses(trace, ["w0"] * 5, [], workers=2, cache_blocks=100)
    assert (whole.moves, whole.replayed_hit_over_bound, whole.lost_by_kind) == (0, 1.0, {})
    with pytest.raises(ValueError, match="per request"):
        sessions.run_losses(trace, ["w0"], [], workers=2, cache_blocks=100)


def test_session_ids_number_sessions_in_order_of_their_first_request() -> None:
    trace = [_req(0, [1, 2]), _req(1, [5]), _req(2, [1, 2, 3]), _req(3, [5, 6]), _req(4, [7])]
    assert sessions.session_ids(trace) == [0, 1, 0, 1, 2]


def test_each_request_waits_for_its_sessions_previous_one() -> None:
    trace = [_req(0, [1, 2]), _req(1, [5]), _req(2, [1, 2, 3]), _req(3, [5, 6]), _req(4, [7]),
             _req(5, [1, 2, 3, 4])]
    assert sessions.previous_in_session(trace) == [-1, -1, 0, 1, -1, 2]


def test_a_turn_waits_the_traces_time_since_its_previous_one_scaled() -> None:
    # Arrivals 0..5 s (request i at i s): request 5 follows request 2 by 3 s, 3 follows 1 by 2.
    trace = [_req(0, [1, 2]), _req(1, [5]), _req(2, [1, 2, 3]), _req(3, [5, 6]), _req(4, [7]),
             _req(5, [1, 2, 3, 4])]
    before = sessions.previous_in_session(trace)
    assert sessions.think_times(trace, before, 0.5) == [0.0, 0.0, 1.0, 1.0, 0.0, 1.5]
    assert sessions.think_times(trace, before, 0.0) == [0.0] * 6
