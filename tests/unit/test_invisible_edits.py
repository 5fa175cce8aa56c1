"""Invisible edits for the replay: each changes the prompt's bytes, never its normalized text."""

from __future__ import annotations

import random

import pytest

from gateway.normalize import normalize_text
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
