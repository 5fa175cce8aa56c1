from __future__ import annotations

import random

from gateway.normalize import normalize_text
from loadtest.bench_normalize import LONG_TEXTS, long_text, measure, to_markdown


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


def test_the_bench_times_every_layout_and_the_remembered_text() -> None:
    result = measure(chars=20_000, runs=2)
    assert list(result) == list(LONG_TEXTS)
    for row in result.values():
        assert set(row) == {"rules", "rules, seen", "fingerprint"}
        assert all(ms > 0 for ms in row.values())
    table = to_markdown(result, 20_000)
    assert "| cjk |" in table
    assert "20,000 characters" in table
