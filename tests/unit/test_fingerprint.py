"""Tests for gateway.fingerprint: chained block hashes, namespaces, anchors, bounds."""

from __future__ import annotations

import random
import re
import string

import pytest
import xxhash

from gateway.fingerprint import (
    FingerprintOptions,
    Namespace,
    PrefixKey,
    checkpoint_depths,
    fingerprint,
)

NS = Namespace(tenant="t1", model="m1")
OPTS = FingerprintOptions(block_chars=8, max_blocks=64, anchor_blocks=3)


def _text(n_chars: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters) for _ in range(n_chars))


def test_same_text_and_namespace_same_key() -> None:
    text = _text(100, 1)
    a = fingerprint(text, NS, OPTS)
    b = fingerprint(text, Namespace(tenant="t1", model="m1"), OPTS)
    assert a == b
    assert a.text_chars == 100


def test_different_text_different_key() -> None:
    assert fingerprint(_text(64, 1), NS, OPTS).blocks != fingerprint(_text(64, 2), NS, OPTS).blocks


@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_shared_prefix_of_k_blocks(k: int) -> None:
    size = OPTS.block_chars
    prefix = _text(k * size, 7)
    a = fingerprint(prefix + "A" * (3 * size), NS, OPTS)
    b = fingerprint(prefix + "B" * (3 * size), NS, OPTS)
    assert len(a.blocks) == len(b.blocks) == k + 3
    assert a.blocks[:k] == b.blocks[:k]
    assert a.blocks[k] != b.blocks[k]
    # The chain carries the difference: every later hash differs as well.
    assert all(x != y for x, y in zip(a.blocks[k:], b.blocks[k:], strict=True))


def test_difference_inside_first_block_changes_every_hash() -> None:
    size = OPTS.block_chars
    tail = _text(4 * size, 3)
    a = fingerprint("x" + "y" * (size - 1) + tail, NS, OPTS)
    b = fingerprint("z" + "y" * (size - 1) + tail, NS, OPTS)
    assert all(x != y for x, y in zip(a.blocks, b.blocks, strict=True))


def test_same_block_content_at_different_positions_hashes_differently() -> None:
    block = "q" * OPTS.block_chars
    key = fingerprint(block * 4, NS, OPTS)
    assert len(set(key.blocks)) == 4


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(Namespace(tenant="t2", model="m1"), id="tenant"),
        pytest.param(Namespace(tenant="t1", model="m2"), id="model"),
        pytest.param(Namespace(tenant="t1", model="m1", adapter="lora-a"), id="adapter"),
        pytest.param(Namespace(tenant="t1", model="m1", cache_salt="s"), id="cache_salt"),
        # Field boundaries are part of the seed: moving characters between fields matters.
        pytest.param(Namespace(tenant="t1m", model="1"), id="field-boundary"),
    ],
)
def test_namespace_fields_change_every_hash(other: Namespace) -> None:
    for text in (_text(5 * OPTS.block_chars, 11), "short"):
        a = fingerprint(text, NS, OPTS)
        b = fingerprint(text, other, OPTS)
        assert len(a.blocks) == len(b.blocks)
        assert all(x != y for x, y in zip(a.blocks, b.blocks, strict=True))
        assert a.anchor != b.anchor


@pytest.mark.parametrize(
    ("n_chars", "n_blocks"),
    [
        pytest.param(1, 1, id="one-char"),
        pytest.param(7, 1, id="short-of-one-block"),
        pytest.param(8, 1, id="exactly-one-block"),
        pytest.param(9, 1, id="one-block-plus-partial"),
        pytest.param(15, 1, id="one-block-plus-long-partial"),
        pytest.param(16, 2, id="two-blocks"),
        pytest.param(8 * 64, 64, id="exactly-max-blocks"),
        pytest.param(8 * 64 + 8, 64, id="over-max-blocks"),
        pytest.param(8 * 1000, 64, id="far-over-max-blocks"),
    ],
)
def test_block_count(n_chars: int, n_blocks: int) -> None:
    key = fingerprint(_text(n_chars, 5), NS, OPTS)
    assert len(key.blocks) == n_blocks
    assert key.text_chars == n_chars


def test_partial_trailing_block_not_hashed() -> None:
    base = _text(3 * OPTS.block_chars, 9)
    full = fingerprint(base, NS, OPTS)
    for tail in ("a", "abc", "abcdefg"):
        assert fingerprint(base + tail, NS, OPTS).blocks == full.blocks


def test_text_shorter_than_block_gets_one_block_and_anchor() -> None:
    a = fingerprint("hey", NS, OPTS)
    b = fingerprint("hex", NS, OPTS)
    assert len(a.blocks) == 1
    assert a.anchor == a.blocks[0]
    assert a.blocks != b.blocks


def test_empty_text_has_no_blocks_but_an_anchor() -> None:
    key = fingerprint("", NS, OPTS)
    assert key.blocks == ()
    assert key.anchor == NS.seed()
    assert key.anchor != fingerprint("", Namespace(tenant="other"), OPTS).anchor


def test_max_blocks_cap_keeps_the_prefix_hashes() -> None:
    text = _text(8 * 100, 13)
    capped = fingerprint(text, NS, FingerprintOptions(block_chars=8, max_blocks=10))
    uncapped = fingerprint(text, NS, FingerprintOptions(block_chars=8, max_blocks=1000))
    assert capped.total_blocks == 10
    assert uncapped.total_blocks == 100
    assert capped.blocks == uncapped.blocks[:10]


@pytest.mark.parametrize(
    ("n_blocks", "anchor_blocks", "anchor_index"),
    [
        pytest.param(10, 4, 3, id="long-prompt"),
        pytest.param(4, 4, 3, id="exactly-anchor-blocks"),
        pytest.param(3, 4, 2, id="shorter-than-anchor-uses-last"),
        pytest.param(1, 4, 0, id="single-block"),
        pytest.param(10, 1, 0, id="anchor-is-first-block"),
        pytest.param(5, 100, 4, id="anchor-beyond-max"),
    ],
)
def test_anchor_position(n_blocks: int, anchor_blocks: int, anchor_index: int) -> None:
    opts = FingerprintOptions(block_chars=8, max_blocks=64, anchor_blocks=anchor_blocks)
    key = fingerprint(_text(8 * n_blocks, 17), NS, opts)
    assert len(key.blocks) == n_blocks
    assert key.anchor == key.blocks[anchor_index]


def test_prompts_sharing_anchor_blocks_share_anchor() -> None:
    prefix = _text(3 * OPTS.block_chars, 19)  # anchor_blocks=3
    a = fingerprint(prefix + _text(40, 1), NS, OPTS)
    b = fingerprint(prefix + _text(80, 2), NS, OPTS)
    assert a.anchor == b.anchor
    assert a.blocks != b.blocks


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("a", id="short"),
        pytest.param(_text(1000, 23), id="long"),
    ],
)
def test_anchor_hex_is_16_hex_chars(text: str) -> None:
    key = fingerprint(text, NS, OPTS)
    assert re.fullmatch(r"[0-9a-f]{16}", key.anchor_hex)
    assert int(key.anchor_hex, 16) == key.anchor


def test_anchor_hex_zero_padded() -> None:
    assert PrefixKey(blocks=(), anchor=0x2A, text_chars=0).anchor_hex == "000000000000002a"


def test_hashes_are_64_bit() -> None:
    key = fingerprint(_text(800, 29), NS, OPTS)
    assert all(0 <= h < 2**64 for h in key.blocks)


def test_blocks_are_characters_not_bytes() -> None:
    # 8 three-byte characters are one block, not three.
    key = fingerprint("\u65e5" * 8, NS, OPTS)
    assert len(key.blocks) == 1
    assert fingerprint("\u65e5" * 16, NS, OPTS).blocks[0] == key.blocks[0]


def test_default_options() -> None:
    opts = FingerprintOptions()
    assert (opts.block_chars, opts.max_blocks, opts.anchor_blocks) == (64, 16_384, 4)
    assert (opts.dense_blocks, opts.checkpoint_ratio) == (64, 32)
    key = fingerprint("x" * (64 * 300), NS)
    assert key.total_blocks == 300
    assert key.anchor == key.blocks[3]
    # A 256k-token prompt (1 MiB) is covered whole, with a few hundred checkpoints.
    whole = fingerprint("y" * (1 << 20), NS)
    assert whole.total_blocks == 16_384
    assert len(whole.blocks) < 400


@pytest.mark.parametrize(
    ("blocks", "dense", "ratio", "expected"),
    [
        pytest.param(5, 8, 4, [1, 2, 3, 4, 5], id="all-dense"),
        # from depth 8: stride = largest power of two <= depth / 4: 2 until 16, then 4
        pytest.param(30, 8, 4, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 30],
                     id="strides-double-and-the-end-is-kept"),
        pytest.param(9, 8, 4, [1, 2, 3, 4, 5, 6, 7, 8, 9], id="end-right-after-dense"),
        pytest.param(0, 8, 4, [], id="empty"),
    ],
)
def test_checkpoint_depths(blocks: int, dense: int, ratio: int, expected: list[int]) -> None:
    opts = FingerprintOptions(dense_blocks=dense, checkpoint_ratio=ratio)
    assert checkpoint_depths(blocks, opts) == expected


@pytest.mark.parametrize("text", ["ascii only " * 60, "na\u00efve caf\u00e9 \u65e5\u672c " * 40])
def test_sparse_checkpoints_chain_over_segments(text: str) -> None:
    """Each checkpoint hash chains over the characters since the previous one, and two prompts
    share exactly the checkpoints inside their common prefix."""
    opts = FingerprintOptions(block_chars=8, dense_blocks=4, checkpoint_ratio=2)
    key = fingerprint(text, NS, opts)
    assert key.depths == tuple(checkpoint_depths(len(text) // 8, opts))
    h, start = NS.seed(), 0
    for depth, got in zip(key.depths, key.blocks, strict=True):
        h = xxhash.xxh3_64_intdigest(text[start : depth * 8].encode("utf-8"), seed=h)
        assert got == h
        start = depth * 8
    common = 8 * 37
    other = fingerprint(text[:common] + "#" * (len(text) - common), NS, opts)
    shared = [d for d in key.depths if d <= 37]
    assert other.blocks[: len(shared)] == key.blocks[: len(shared)]
    assert other.blocks[len(shared)] != key.blocks[len(shared)]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"block_chars": 0}, id="block_chars-0"),
        pytest.param({"block_chars": -8}, id="block_chars-negative"),
        pytest.param({"max_blocks": 0}, id="max_blocks-0"),
        pytest.param({"anchor_blocks": 0}, id="anchor_blocks-0"),
        pytest.param({"anchor_blocks": -1}, id="anchor_blocks-negative"),
    ],
)
def test_invalid_options_raise(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        FingerprintOptions(**kwargs)


def test_anchor_past_on_dense_keys() -> None:
    """Every block a checkpoint (trace keys): as far past ``depth`` as the anchor is past the
    start, or the last block of a shorter prompt."""
    blocks = tuple(range(100, 120))
    key = PrefixKey(blocks, blocks[3], 0)  # anchor at depth 4
    assert key.anchor_past(0) == key.anchor
    assert key.anchor_past(5) == blocks[8]
    assert key.anchor_past(18) == blocks[19]


@pytest.mark.parametrize("trunk", [3, 10, 40, 70])
def test_anchor_past_names_what_follows_the_trunk(trunk: int) -> None:
    opts = FingerprintOptions(block_chars=8, max_blocks=512, anchor_blocks=3, dense_blocks=16,
                              checkpoint_ratio=4)
    head = _text(8 * trunk, 5)
    follow = _text(8 * 40, 6)
    a = fingerprint(head + follow + _text(80, 7), NS, opts)
    b = fingerprint(head + follow + _text(160, 8), NS, opts)
    c = fingerprint(head + _text(8 * 40 + 80, 9), NS, opts)
    assert a.anchor == c.anchor  # one trunk (>= anchor_blocks), one ring position
    assert a.anchor_past(trunk) == b.anchor_past(trunk)  # the same continuation
    assert a.anchor_past(trunk) != c.anchor_past(trunk)  # another one
    i = a.blocks.index(a.anchor_past(trunk))
    depth = a.depth_at(i)
    # Past the trunk: within anchor_blocks of it where a checkpoint lies there, else the next.
    assert depth > trunk
    inside = [d for d in a.depths if trunk < d <= trunk + 3]
    assert depth == (inside[-1] if inside else min(d for d in a.depths if d > trunk))


@pytest.mark.parametrize("extra", [0, 8 * 3, 8 * 40])
def test_a_prompt_goes_on_from_an_earlier_turn_it_extends(extra: int) -> None:
    """A session's next turn goes on from the whole of its last one, whether or not that
    turn's last block is a checkpoint of the longer prompt; a prompt that parts from it
    before its last two checkpoints, a shorter one, or another session's does not (where it
    parts past the deeper of the two that both have is not seen: within a stride, 1/32 of
    the depth by default)."""
    opts = FingerprintOptions(block_chars=8, dense_blocks=4, checkpoint_ratio=2)
    turn = _text(8 * 45 + 5, 1)  # 45 blocks: depth 45 is no checkpoint of a longer prompt
    last = fingerprint(turn, NS, opts)
    assert 45 not in checkpoint_depths(45 + extra // 8 + 1, opts)
    following = fingerprint(turn + _text(extra + 8, 2), NS, opts)
    assert following.goes_on_from(last)
    assert last.goes_on_from(last)
    parted = fingerprint(turn[: 8 * 30] + "#" * (8 * 15 + 5 + extra + 8), NS, opts)
    assert not parted.goes_on_from(last)
    assert not fingerprint(turn[: 8 * 20], NS, opts).goes_on_from(last)
    assert not fingerprint(_text(len(turn) + extra, 3), NS, opts).goes_on_from(last)


def test_keys_with_every_block_a_checkpoint_go_on_from_their_prefixes() -> None:
    """Trace keys (``depths`` empty): a longer key goes on from its own prefix, a shorter or
    a different one does not."""
    turn = PrefixKey((1, 2, 3, 4, 5), 1, 320)
    assert PrefixKey((1, 2, 3, 4, 5, 6, 7), 1, 448).goes_on_from(turn)
    assert not PrefixKey((1, 2, 3), 1, 192).goes_on_from(turn)
    assert not PrefixKey((1, 2, 9, 9, 9, 9), 1, 384).goes_on_from(turn)
