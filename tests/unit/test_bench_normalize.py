from __future__ import annotations

import random

from gateway.normalize import NormalizeOptions, normalize_text
from gateway.openai_schema import decode_json_object, parse_chat
from loadtest.bench_normalize import (
    LONG_TEXTS,
    long_text,
    measure,
    measure_sessions,
    measure_transcripts,
    to_markdown,
    transcript,
)


def test_long_texts_have_the_size_and_the_line_ends_asked_for() -> None:
    texts = {layout: long_text(random.Random(3), 20_000, layout) for layout in LONG_TEXTS}
    assert all(len(t) == 20_000 for t in texts.values())
    assert "\n" not in texts["words"]
    lines = texts["lines"].split("\n")
    assert len(lines) > 100
    assert any(line.startswith("    ") for line in lines)
    # Only the ragged layout has lines the normalization must rewrite.
    assert normalize_text(texts["lines"]) == texts["lines"]
    assert normalize_text(texts["words"]) == texts["words"]
    for layout in ("typeset", "emoji", "cjk"):
        assert normalize_text(texts[layout]) == texts[layout]
        assert not texts[layout].isascii()
    ragged = normalize_text(texts["ragged"])
    assert ragged != texts["ragged"]
    assert " \n" not in ragged

    # ...also once a next turn adds a line: no other layout ends its last line in a space,
    # wherever the size cuts it.
    for seed in range(40):
        for layout in LONG_TEXTS:
            if layout != "ragged":
                turn = long_text(random.Random(seed), 3_000 + seed, layout) + "\nTurn 1: ok"
                assert normalize_text(turn) == turn, (seed, layout)


def test_the_bench_times_every_layout_and_the_remembered_text() -> None:
    result = measure(chars=20_000, runs=2)
    assert list(result) == list(LONG_TEXTS)
    for row in result.values():
        assert set(row) == {"rules", "rules, seen", "next turn", "next turn, seen", "fingerprint",
                            "fingerprint, next turn"}
        assert all(ms > 0 for ms in row.values())
    table = to_markdown(result, 20_000)
    assert "| cjk |" in table
    assert "20,000 characters" in table


def test_a_transcript_alternates_tool_calls_and_their_results() -> None:
    body = decode_json_object(transcript(6))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system"] + ["assistant", "tool"] * 3
    calls = [m["tool_calls"][0]["id"] for m in body["messages"] if m["role"] == "assistant"]
    assert calls == [m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"]
    rendered = parse_chat(body, NormalizeOptions()).fingerprint_text
    assert all(call in rendered for call in calls)
    rows = measure_transcripts([6], runs=1)
    assert set(next(iter(rows.values()))) == {"decode", "parse_chat", "fingerprint"}


def test_a_long_transcripts_next_turn_is_timed_as_the_gateway_joins_it() -> None:
    earlier, turn = decode_json_object(transcript(200)), decode_json_object(transcript(200, turn=2))
    assert turn["messages"][:-2] == earlier["messages"]
    rows = measure_transcripts([6, 200], runs=1)
    short, long = rows.values()
    assert "next turn: decode + parse_chat" not in short  # too short to be remembered
    assert long["next turn: decode + parse_chat"] > 0


def test_interleaved_agents_sharing_an_opening_each_go_on_from_their_last_turn() -> None:
    result = measure_sessions(sessions=5, turns=4, opening_chars=10_000, turn_chars=500)
    assert list(result) == ["lines", "typeset"]
    for row in result.values():
        assert row["fingerprint, next turn"] > 0
        assert row["chars"] > 10_000 + 4 * 500
        assert row["hit share"] == 3 / 4  # every turn after each agent's first
