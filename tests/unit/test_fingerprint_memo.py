"""Tests for gateway.fingerprint's ``prior`` and gateway.fingerprint_memo: a prompt that
extends one fingerprinted before is hashed past it, to the same key."""

from __future__ import annotations

import random

import pytest

from gateway.fingerprint import FingerprintOptions, Namespace, fingerprint
from gateway.fingerprint_memo import FingerprintMemo

NS = Namespace(tenant="t1", model="m1")
SMALL = FingerprintOptions(block_chars=8, max_blocks=300, anchor_blocks=3, dense_blocks=8,
                           checkpoint_ratio=4)


def _text(chars: int, seed: int, alphabet: str) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(alphabet) for _ in range(chars))


@pytest.mark.parametrize("alphabet", ["abc \n", "ab\u2019\u00e9 ", "a\U0001f600\u4e2d "])
@pytest.mark.parametrize("opts", [SMALL, FingerprintOptions(block_chars=4, max_blocks=40,
                                                            dense_blocks=4, checkpoint_ratio=2)])
def test_a_key_hashed_past_a_prior_one_is_the_key_hashed_whole(
    alphabet: str, opts: FingerprintOptions,
) -> None:
    text = _text(opts.block_chars * 700, 1, alphabet)  # past max_blocks: the cap holds too
    for cut in (0, 3, opts.block_chars, 37, 101, 250, 1000, 2399, len(text) - 1, len(text)):
        prior = fingerprint(text[:cut], NS, opts)
        for end in (cut, cut + 1, cut + 9, cut + 500, len(text)):
            if end > len(text):
                continue
            whole = fingerprint(text[:end], NS, opts)
            assert fingerprint(text[:end], NS, opts, prior) == whole, (cut, end)


def test_the_memo_gives_fingerprint_s_keys_turn_after_turn() -> None:
    memo = FingerprintMemo(min_chars=100)
    base = _text(3000, 2, "ab\u2019 \n")
    turns = [base]
    for i in range(6):  # an agent's turns
        turns.append(turns[-1] + _text(70 + i, 10 + i, "xyz \n"))
    # A fork from an earlier turn: that turn is no longer kept (the next one replaced it), so
    # it is hashed whole; then its own next turn begins from it.
    turns += [turns[2] + "a fork", turns[2] + "a fork, and more"]
    for text in turns:
        assert memo.fingerprint(text, NS, SMALL) == fingerprint(text, NS, SMALL)
    assert memo.hits == len(turns) - 2
    # Another namespace (tenant, salt) never begins from these keys; still the same keys.
    other = Namespace(tenant="t2", model="m1")
    assert memo.fingerprint(turns[-1], other, SMALL) == fingerprint(turns[-1], other, SMALL)
    assert memo.hits == len(turns) - 2
    # A text with the same opening that does not extend a kept one is hashed whole.
    last = turns[-1]
    parted = last[:2000] + "#" + last[2001:] + "more"
    assert memo.fingerprint(parted, NS, SMALL) == fingerprint(parted, NS, SMALL)
    assert memo.hits == len(turns) - 2


def test_the_memo_holds_its_texts_within_its_budget() -> None:
    memo = FingerprintMemo(max_bytes=5000, min_chars=100)
    texts = [_text(2000, seed, "abc ") for seed in range(4)]
    for text in texts:
        memo.fingerprint(text, NS, SMALL)
    assert memo.held_bytes <= 5000
    assert len(memo) == 2  # the two latest
    # A text's next turn replaces it; short texts are not kept.
    memo.fingerprint(texts[-1] + "more", NS, SMALL)
    assert (len(memo), memo.held_bytes, memo.hits) == (2, 4004, 1)
    memo.fingerprint("short", NS, SMALL)
    assert len(memo) == 2
    wide = FingerprintMemo(min_chars=100)
    wide.fingerprint("\u2019" * 1000, NS, SMALL)  # stored two bytes a character
    assert wide.held_bytes == 2000
    off = FingerprintMemo(max_bytes=0, min_chars=100)
    assert off.fingerprint(texts[0], NS, SMALL) == fingerprint(texts[0], NS, SMALL)
    assert len(off) == 0


def test_sessions_that_share_an_opening_each_go_on_from_their_own_last_turn() -> None:
    # Agents of one deployment: the same long system prompt and tools first, then each
    # session's own context; their turns interleave.
    memo = FingerprintMemo(min_chars=100)
    shared = _text(1500, 3, "ab\u2019 \n")
    sessions = [shared + _text(50, 20 + s, "xyz \n") for s in range(6)]
    for turn in range(4):
        for s in range(len(sessions)):
            sessions[s] += _text(40 + turn, 100 * s + turn, "pq\u00e9 \n")
            assert memo.fingerprint(sessions[s], NS, SMALL) == fingerprint(sessions[s], NS, SMALL)
    assert memo.hits == 6 * 3  # every turn after each session's first
    assert len(memo) == 6  # the last turn of each


def test_a_full_memo_lets_the_least_recently_used_text_go() -> None:
    texts = [_text(1000, 1, "abc ") + _text(1000, 50 + s, "xyz ") for s in range(4)]
    memo = FingerprintMemo(max_bytes=6500, min_chars=100)  # three texts of 2,000 bytes
    for text in texts:
        memo.fingerprint(text, NS, SMALL)
    assert (len(memo), memo.held_bytes) == (3, 6000)
    # The first went; the three others are still gone on from.
    for text in texts[1:]:
        memo.fingerprint(text + "more", NS, SMALL)
    assert memo.hits == 3
    memo.fingerprint(texts[0] + "more", NS, SMALL)
    assert memo.hits == 3
    few = FingerprintMemo(min_chars=100, per_opening=2)  # at most two per opening
    for text in texts[:3]:
        few.fingerprint(text, NS, SMALL)
    assert len(few) == 2
    assert few.fingerprint(texts[0] + "more", NS, SMALL) == fingerprint(texts[0] + "more", NS,
                                                                       SMALL)
    assert few.hits == 0
