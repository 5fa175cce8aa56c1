"""The deterministic hash tokenizer."""

from __future__ import annotations

import pytest
import xxhash

from worker.tokenizer import HashTokenizer, HFTokenizer, TokenizerUnavailableError, load_tokenizer

PROSE = (
    "Prefix caching lets an inference server reuse the attention keys and values computed for "
    "a prompt that shares its beginning with an earlier one. A router that sends similar "
    "prompts to the same replica therefore saves prefill work, lowers the time to first token, "
    "and frees capacity for other requests. The catch is load: if every request shares one "
    "system prompt, naive affinity piles all traffic onto a single machine."
)


def test_deterministic_and_in_vocab() -> None:
    tok = HashTokenizer()
    ids = tok.encode(PROSE)
    assert ids == HashTokenizer().encode(PROSE)
    assert all(0 <= i < 50257 for i in ids)


def test_token_id_is_xxh32_of_the_chunk() -> None:
    tok = HashTokenizer()
    assert tok.encode("hello") == [
        xxhash.xxh32_intdigest(b"hell") % 50257,
        xxhash.xxh32_intdigest(b"o") % 50257,
    ]


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hello, world!", ["Hell", "o", ",", " wor", "ld", "!"]),
        ("It's 2024.", ["It", "'s", " 2", "0", "2", "4", "."]),
        ("a  b", ["a", " ", " b"]),
        ("x\n\ny", ["x", "\n", "\n", "y"]),
        ("end   ", ["end", "   "]),
        ("", []),
    ],
)
def test_pieces_follow_gpt2_regex_and_4_char_chunks(text: str, pieces: list[str]) -> None:
    tok = HashTokenizer()
    assert tok.pieces(text) == pieces
    assert "".join(tok.pieces(text)) == text  # lossless


def test_about_three_to_four_chars_per_token_on_english() -> None:
    chars_per_token = len(PROSE) / len(HashTokenizer().encode(PROSE))
    assert 2.8 <= chars_per_token <= 4.5


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("You are a helpful assistant.", " Answer briefly."),
        ("<|user|>\nhello", "\n<|assistant|>"),
        ("Document: 1234", "  more text"),
        (PROSE, " " + PROSE),
    ],
)
def test_split_before_whitespace_tokenizes_piecewise(a: str, b: str) -> None:
    tok = HashTokenizer()
    assert tok.encode(a + b) == tok.encode(a) + tok.encode(b)


def test_split_inside_a_word_is_not_piecewise() -> None:
    tok = HashTokenizer()
    assert tok.encode("hello") != tok.encode("hel") + tok.encode("lo")
    # ...and a trailing space joins the next word, so text ending in whitespace is no prefix.
    assert tok.encode("a b") != tok.encode("a ") + tok.encode("b")


def test_vocab_size_is_configurable() -> None:
    assert all(i < 7 for i in HashTokenizer(vocab_size=7).encode(PROSE))
    with pytest.raises(ValueError, match="vocab_size"):
        HashTokenizer(vocab_size=1)


def test_load_tokenizer_default_is_hash() -> None:
    assert isinstance(load_tokenizer(""), HashTokenizer)


def test_hf_tokenizer_missing_package_or_file_is_a_clear_error() -> None:
    with pytest.raises(TokenizerUnavailableError, match="tokenizer"):
        HFTokenizer("/nonexistent/tokenizer.json")
