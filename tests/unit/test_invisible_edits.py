"""Invisible edits for the replay: each changes the prompt's bytes, never its normalized text."""

from __future__ import annotations

import random
import re

import pytest

from gateway.normalize import NormalizeOptions, normalize_text
from loadtest.replay import request_bodies
from loadtest.textgen import TextSynth, invisible_edit
from loadtest.traces import TraceRequest, prefix_key


@pytest.mark.parametrize("seed", range(40))
def test_an_invisible_edit_changes_the_bytes_and_normalizes_away(seed: int) -> None:
    text = TextSynth(chars=64).prompt(range(seed, seed + 5))
    edited = invisible_edit(text, random.Random(seed))
    assert edited != text
    assert normalize_text(edited) == normalize_text(text)


def test_the_share_of_edited_requests_follows_the_option() -> None:
    requests = [TraceRequest(i, 0.0, 32, 1, prefix_key((i % 7, 1000 + i), 32))
                for i in range(2000)]
    plain = request_bodies(requests, 64, 1)
    edited = request_bodies(requests, 64, 1, invisible_edits=0.3)
    changed = sum(a["prompt"] != b["prompt"] for a, b in zip(plain, edited, strict=True))
    assert 500 <= changed <= 700  # 30% of 2,000, seeded
    assert request_bodies(requests, 64, 1, invisible_edits=0.3) == edited  # reproducible
    assert all(normalize_text(a["prompt"]) == normalize_text(b["prompt"])
               for a, b in zip(plain, edited, strict=True))


def test_text_in_lines_is_the_same_words_and_blocks() -> None:
    flat, lined = TextSynth(chars=128, seed=4), TextSynth(chars=128, seed=4, lines=True)
    for block in range(50):
        text = lined.block(block)
        assert "\n" in text
        assert len(text) == 128
        assert text[0] == " "  # the chunk's shape, as without lines
        assert not text[-1].isspace()
        assert text.replace("\n", " ") == flat.block(block)


@pytest.mark.parametrize("seed", range(40))
def test_an_edit_of_text_in_lines_normalizes_away(seed: int) -> None:
    text = TextSynth(chars=64, lines=True).prompt(range(seed, seed + 5))
    edited = invisible_edit(text, random.Random(seed))
    assert edited != text
    assert normalize_text(edited) == normalize_text(text)


def test_text_in_lines_draws_trailing_spaces_on_inner_lines() -> None:
    text = TextSynth(chars=64, lines=True).prompt(range(40))
    edits = [invisible_edit(text, random.Random(seed)) for seed in range(400)]
    inner = [e for e in edits if re.search(r" +\n", e)]
    assert 20 <= len(inner) <= 80  # one kind of eight
    keep = NormalizeOptions(line_trailing_whitespace=False)
    # The rule that undoes them: without it, each is another prompt from its edit on.
    assert all(normalize_text(e, keep) != normalize_text(text, keep) for e in inner)
    assert all(normalize_text(e) == normalize_text(text) for e in inner)


def test_text_without_lines_draws_no_inner_line_edit() -> None:
    text = TextSynth(chars=64).prompt(range(40))
    assert "\n" not in text
    edits = [invisible_edit(text, random.Random(seed)) for seed in range(200)]
    assert all("\n" not in e for e in edits)
    assert sum(e.endswith(" ") for e in edits) > 0  # trailing spaces at the end still come


def test_request_bodies_in_lines() -> None:
    requests = [TraceRequest(i, 0.0, 32, 1, prefix_key((i % 7, 1000 + i), 32))
                for i in range(200)]
    plain = request_bodies(requests, 64, 1, lines=True)
    edited = request_bodies(requests, 64, 1, invisible_edits=0.5, lines=True)
    assert all("\n" in b["prompt"] for b in plain)
    assert [b["prompt"].replace("\n", " ") for b in plain] == [
        b["prompt"] for b in request_bodies(requests, 64, 1)]
    assert all(normalize_text(a["prompt"]) == normalize_text(b["prompt"])
               for a, b in zip(plain, edited, strict=True))
