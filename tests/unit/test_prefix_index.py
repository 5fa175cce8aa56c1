"""Tests for gateway.routing.prefix_index.PrefixIndex (chain matching, TTL, capacity)."""

from __future__ import annotations

import pytest
import xxhash

from gateway.routing.prefix_index import PrefixIndex

Recording = tuple[str, str]


def P(text: str) -> tuple[int, ...]:
    """Chained block ids of a prompt of one-character blocks: id ``i`` names ``text[: i + 1]``
    (as fingerprint hashes do, so equal ids mean equal prefixes)."""
    return tuple(xxhash.xxh3_64_intdigest(text[: i + 1].encode()) for i in range(len(text)))


@pytest.mark.parametrize(
    ("recordings", "query", "expected"),
    [
        pytest.param([], "abc", {}, id="empty-index"),
        pytest.param([("abc", "w1")], "", {}, id="empty-query"),
        pytest.param([("abc", "w1")], "abc", {"w1": 3}, id="full-match"),
        pytest.param([("abc", "w1")], "abcde", {"w1": 3}, id="query-longer"),
        pytest.param([("abcde", "w1")], "ab", {"w1": 2}, id="query-shorter"),
        pytest.param([("abc", "w1")], "xbc", {}, id="first-block-differs"),
        pytest.param([("abde", "w1")], "abcde", {"w1": 2}, id="stops-where-prompts-diverge"),
        pytest.param(
            [("ab", "w1"), ("cd", "w2")], "abcd", {"w1": 2},
            id="a-prompt-that-starts-elsewhere-does-not-count",
        ),
        pytest.param(
            [("abc", "w1"), ("a", "w2"), ("abcde", "w3")],
            "abcd",
            {"w1": 3, "w2": 1, "w3": 4},
            id="several-holders-different-depths",
        ),
        pytest.param([("ab", "w1"), ("ab", "w2")], "ab", {"w1": 2, "w2": 2}, id="equal-holders"),
        pytest.param(
            [("abc", "w1"), ("ac", "w2")], "abc", {"w1": 3, "w2": 1}, id="sibling-branch",
        ),
        pytest.param(
            [("abcdefgh", "w1"), ("abcdxy", "w2"), ("abz", "w3"), ("q", "w4")], "abcdefgz",
            {"w1": 7, "w2": 4, "w3": 2}, id="many-depths-found-by-search",
        ),
    ],
)
def test_match(recordings: list[Recording], query: str, expected: dict[str, int]) -> None:
    index = PrefixIndex()
    for text, wid in recordings:
        index.record(P(text), wid, 0.0)
    assert index.match(P(query), 0.0) == expected


def test_record_is_idempotent() -> None:
    index = PrefixIndex()
    index.record([1, 2, 3], "w1", 0.0)
    index.record([1, 2, 3], "w1", 0.0)
    assert len(index) == 3
    assert index.match([1, 2, 3], 0.0) == {"w1": 3}


@pytest.mark.parametrize(
    ("events", "now", "expected"),
    [
        pytest.param([(0.0, [1, 2, 3], "w1")], 5.0, {"w1": 3}, id="fresh"),
        pytest.param([(0.0, [1, 2, 3], "w1")], 10.0, {"w1": 3}, id="exactly-ttl-still-counts"),
        pytest.param([(0.0, [1, 2, 3], "w1")], 10.5, {}, id="expired"),
        pytest.param(
            [(0.0, [1, 2, 3], "w1"), (8.0, [1, 2, 3], "w1")], 15.0, {"w1": 3},
            id="re-record-refreshes",
        ),
        pytest.param(
            [(0.0, [1, 2, 3], "w1"), (8.0, [1], "w1")], 15.0, {"w1": 1},
            id="partial-refresh-shortens-match",
        ),
        pytest.param(
            [(0.0, [1, 2, 3], "w1"), (8.0, [1, 2], "w2")], 15.0, {"w2": 2},
            id="one-holder-expired-other-fresh",
        ),
        pytest.param(
            [(0.0, [1, 2, 3], "w1"), (8.0, [1, 2], "w2")], 19.0, {},
            id="both-expired",
        ),
    ],
)
def test_ttl(
    events: list[tuple[float, list[int], str]], now: float, expected: dict[str, int]
) -> None:
    index = PrefixIndex(ttl_s=10.0)
    for t, blocks, wid in events:
        index.record(blocks, wid, t)
    assert index.match([1, 2, 3], now) == expected


def test_capacity_is_per_worker_lru() -> None:
    index = PrefixIndex(capacity=3)
    for h in (1, 2, 3):
        index.record([h], "w1", 0.0)
    index.record([1], "w2", 0.0)  # another worker's record does not refresh w1's entry
    index.record([1], "w1", 0.0)  # refreshes block 1 for w1: block 2 is now its oldest
    index.record([4], "w1", 0.0)
    assert index.held_blocks("w1") == 3
    assert index.match([2], 0.0) == {}
    assert index.match([1], 0.0) == {"w1": 1, "w2": 1}
    assert index.match([3], 0.0) == {"w1": 1}
    index.record([5, 6], "w1", 0.0)  # evicts w1's two oldest: 3, then 1
    assert index.match([3], 0.0) == {}
    assert index.match([4], 0.0) == {"w1": 1}
    assert index.match([1], 0.0) == {"w2": 1}  # w2's own LRU still holds it
    assert index.match([5, 6], 0.0) == {"w1": 2}


def test_a_prompts_head_outlives_its_tail() -> None:
    """Recording deepest-first keeps the first blocks most recently used, as a worker does."""
    index = PrefixIndex(capacity=4)
    index.record([1, 2, 3], "w1", 0.0)
    index.record([7, 8], "w1", 0.0)  # evicts the least recently used: block 3, the old tail
    assert index.match([1, 2, 3], 0.0) == {"w1": 2}


def test_capacity_never_exceeded_per_worker() -> None:
    index = PrefixIndex(capacity=50)
    index.set_capacity("w0", 20)
    for i in range(40):
        index.record(range(i * 7, i * 7 + 7), f"w{i % 3}", 0.0)
        assert index.held_blocks("w0") <= 20
        assert index.held_blocks("w1") <= 50
    assert index.held_blocks("w0") == 20
    assert index.held_blocks("w1") == 50
    assert len(index) == 20 + 50 + 50


def test_set_capacity_trims_and_shed_drops_the_oldest() -> None:
    index = PrefixIndex()
    index.record(list(range(10)), "w1", 0.0)
    index.set_capacity("w1", 6)
    assert index.match(list(range(10)), 0.0) == {"w1": 6}
    assert index.shed("w1", 0.5) == 3
    assert index.match(list(range(10)), 0.0) == {"w1": 3}
    index.forget("w1", list(range(10)), keep=1)  # a prediction past block 0 did not happen
    assert index.match(list(range(10)), 0.0) == {"w1": 1}
    assert index.held_blocks("w1") == 1


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(capacity=capacity)


def test_forget_worker() -> None:
    index = PrefixIndex()
    index.record([1, 2, 3], "w1", 0.0)
    index.record([1, 2], "w2", 0.0)
    index.record([7, 8], "w1", 0.0)
    assert len(index) == 5
    index.forget_worker("w1")
    assert index.match([1, 2, 3], 0.0) == {"w2": 2}
    assert index.match([7, 8], 0.0) == {}
    assert len(index) == 2  # blocks nobody holds any more are dropped
    index.forget_worker("w1")  # forgetting twice is harmless
    index.forget_worker("unknown")
    assert len(index) == 2
    index.forget_worker("w2")
    assert len(index) == 0
    assert index.match([1, 2], 0.0) == {}


def test_forgotten_worker_can_record_again() -> None:
    index = PrefixIndex()
    index.record([1, 2], "w1", 0.0)
    index.forget_worker("w1")
    index.record([1], "w1", 0.0)
    assert index.match([1, 2], 0.0) == {"w1": 1}


def test_heat_counts_recent_requests_and_halves_with_time() -> None:
    index = PrefixIndex(heat_half_life_s=10.0)
    for _ in range(8):
        index.record([1, 2], "w1", 0.0)
    index.record([1, 3], "w2", 0.0)
    # A request heats the deepest part it shares with what is known, and its end when new:
    # [1, 2] eight times heats 2 (new once, then shared seven times); [1, 3] shares 1.
    assert index.heat(1, 0.0) == pytest.approx(1.0)
    assert index.heat(2, 0.0) == pytest.approx(8.0)
    assert index.heat(3, 0.0) == pytest.approx(1.0)
    assert index.heat(99, 0.0) == 0.0
    now = 10.0
    assert index.heat(2, now) == pytest.approx(4.0)
    index.record([1, 2, 4], "w1", now)
    assert index.heat(2, now) == pytest.approx(5.0)
    index.forget_worker("w1")
    index.forget_worker("w2")
    assert index.heat(1, now) == 0.0  # gone with the last holder


def test_churn_counts_requests_and_new_blocks_and_halves_with_time() -> None:
    index = PrefixIndex(heat_half_life_s=10.0)
    now = 100.0
    index.record([1, 2, 3, 4], "w1", now)  # 4 new blocks
    index.record([1, 2, 3, 4, 5, 6], "w1", now)  # 2 new blocks: the first 4 are held
    index.record([7, 8], "w2", now)  # 2 new blocks on another worker
    assert index.recent_requests("w1", now) == pytest.approx(2.0)
    assert index.recent_requests("w2", now) == pytest.approx(1.0)
    assert index.recent_requests("w9", now) == 0.0
    assert index.mean_new_blocks() == pytest.approx((4 + 2 + 2) / 3)
    now = 110.0  # one half-life later
    assert index.recent_requests("w1", now) == pytest.approx(1.0)
    index.record([9] * 1 + [10, 11, 12, 13, 14, 15, 16], "w2", now)  # 8 new blocks, weighs double
    assert index.mean_new_blocks() == pytest.approx((8 * 0.5 + 8) / (3 * 0.5 + 1))
    index.forget_worker("w1")
    assert index.recent_requests("w1", now) == 0.0


def test_recent_blocks_count_whole_prompts_cached_part_included_and_halve() -> None:
    index = PrefixIndex(heat_half_life_s=10.0)
    now = 100.0
    index.record([1, 2, 3, 4], "w1", now)
    index.record([1, 2, 3, 4, 5, 6], "w1", now)  # 2 new blocks, but a 6-block prompt routed
    index.record([7, 8], "w2", now, depths=(16, 32))  # sparse checkpoints: 32 blocks deep
    assert index.recent_blocks("w1", now) == pytest.approx(10.0)
    assert index.recent_blocks("w2", now) == pytest.approx(32.0)
    assert index.recent_blocks("w9", now) == 0.0
    assert index.pool_recent_blocks(now) == pytest.approx(42.0)
    view = index.at(now + 10.0)  # one half-life later
    assert view.recent_blocks("w1") == pytest.approx(5.0)
    assert view.pool_recent_blocks() == pytest.approx(21.0)
    index.forget_worker("w1")
    assert index.recent_blocks("w1", now) == 0.0


def test_extends_tells_a_sessions_next_turn_from_a_prompt_shared_from_inside() -> None:
    index = PrefixIndex()
    index.record([1, 2, 3, 4], "w1", 0.0)  # a prompt of 4 blocks
    assert index.extends(4, 5)  # going on from its end: the next turn
    assert not index.extends(2, 3)  # going on from inside it: sharing its first 2 blocks
    assert not index.extends(99, 100)  # unknown
    index.record([11, 12], "w1", 0.0, depths=(16, 32))  # sparse: its end is at depth 32
    assert index.extends(12, 48)
    assert not index.extends(11, 32)
    assert index.at(0.0).extends(4, 6)


def test_session_blocks_count_a_chain_of_prompts_extending_each_other() -> None:
    index = PrefixIndex(heat_half_life_s=10.0)
    index.record([1, 2, 3], "w1", 0.0)  # a session's first turn
    index.record([1, 2, 3, 4, 5], "w1", 0.0)  # its next turn: extends it
    index.record([1, 2, 9], "w2", 0.0)  # shares [1, 2] from inside: a session of its own
    assert index.session_blocks(5, 0.0) == pytest.approx(3 + 5)
    assert index.session_blocks(3, 0.0) == pytest.approx(3 + 5)  # any prefix it recorded
    assert index.session_blocks(9, 0.0) == pytest.approx(3)
    assert index.at(10.0).session_blocks(5) == pytest.approx(4.0)  # one half-life later
    index.record([1, 2, 3, 4, 5, 6], "w2", 10.0)  # the session goes on, on another worker
    assert index.session_blocks(6, 10.0) == pytest.approx(4.0 + 6)
    assert index.session_blocks(99, 10.0) == 0.0


def test_tail_age_is_infinite_until_the_modelled_cache_is_full() -> None:
    index = PrefixIndex()
    index.set_capacity("w1", 4)
    now = 10.0
    index.record([1, 2], "w1", now)
    assert index.tail_age("w1", now) == float("inf")
    assert index.tail_age("unknown", now) == float("inf")
    now = 25.0
    index.record([3, 4], "w1", now)  # full now: its oldest blocks were recorded at t=10
    now = 30.0
    assert index.tail_age("w1", now) == pytest.approx(20.0)
    index.record([5], "w1", now)  # evicts block 2 (the deepest of the oldest prompt goes first)
    assert index.tail_age("w1", now) == pytest.approx(20.0)  # block 1 is still from t=10
    index.record([6], "w1", now)  # evicts block 1: now the oldest is from t=25
    assert index.tail_age("w1", now) == pytest.approx(5.0)


def test_branched_tells_a_trunk_from_the_end_of_a_prompt() -> None:
    idx = PrefixIndex()
    trunk, session = [1, 2, 3], [1, 2, 3, 10, 11]
    idx.record(session, "w1", 0.0)
    assert idx.branched(3)  # w1 holds a checkpoint below it: a prompt went on past it
    assert not idx.branched(11)  # the end of the recorded prompt
    assert not idx.branched(99)  # unknown
    idx.record(trunk, "w2", 0.0)  # w2 holds only the trunk: w1's hold still makes it one
    assert idx.branched(3)
    idx.forget_worker("w1")
    assert not idx.branched(3)  # w2 holds nothing past it


def test_pool_recent_requests_counts_every_worker_and_halves() -> None:
    idx = PrefixIndex(heat_half_life_s=10.0)
    assert idx.pool_recent_requests(0.0) == 0.0
    idx.record([1, 2], "w1", 0.0)
    idx.record([3, 4], "w2", 0.0)
    idx.record([1, 2], "w1", 0.0)
    assert idx.pool_recent_requests(0.0) == pytest.approx(3.0)
    assert idx.pool_recent_requests(10.0) == pytest.approx(1.5)
    assert idx.at(10.0).pool_recent_requests() == pytest.approx(1.5)


# Prompts as text of one-character blocks: S is a shared system prompt; after it, upper-case
# letters are a session's or a document's own blocks, digits a question.
GROW_CASES = [
    pytest.param([], "S", True, id="nothing-seen"),
    # Sessions off S, each later extended by its next turn: the branches grow.
    pytest.param(["SSSSAAAA", "SSSSBBBB", "SSSSBBBBbb", "SSSSCCCC", "SSSSCCCCcc"], "SSSS", True,
                 id="sessions-extend-their-branches"),
    # Documents off S, reused by later questions from inside: the branches do not grow.
    pytest.param(["SSSSAAAA1", "SSSSBBBB2", "SSSSBBBB3", "SSSSCCCC4", "SSSSCCCC5"], "SSSS",
                 False, id="documents-reused-from-inside"),
    # A new session off S reuses the first prompt up to S: that finds the fork, it is not a
    # reuse of a branch (else every first session would count against the sessions after it).
    pytest.param(["SSSSAAAA", "SSSSBBBB"], "SSSS", True, id="finding-the-fork-is-no-reuse"),
    # Reused from inside at two points (each counts once: going on from a point that is
    # already a fork is neither), extended once.
    pytest.param(["SSSSAAAA1", "SSSSBBBB2", "SSSSBBBB3", "SSSSBBBB4", "SSSSBBBX5", "SSSSCCCC",
                  "SSSSCCCCcc"], "SSSS", False, id="more-reused-than-extended"),
    pytest.param(["SSSSAAAA1", "SSSSBBBB2", "SSSSBBBB3", "SSSSBBBB4", "SSSSCCCC", "SSSSCCCCcc"],
                 "SSSS", True, id="a-reused-point-counts-once"),
    # A fork with no record of its own (T) is taken to be like the pool's forks so far.
    pytest.param(["SSSSAAAA1", "SSSSBBBB2", "SSSSBBBB3", "TTTTAAAA", "TTTTBBBB"], "TTTT", False,
                 id="a-new-fork-follows-the-pool"),
    pytest.param(["SSSSAAAA", "SSSSBBBB", "SSSSBBBBbb", "TTTTAAAA", "TTTTBBBB"], "TTTT", True,
                 id="a-new-fork-follows-the-pool-of-sessions"),
]


@pytest.mark.parametrize(("prompts", "trunk", "expected"), GROW_CASES)
def test_branches_grow_tells_sessions_from_shared_documents(
    prompts: list[str], trunk: str, expected: bool
) -> None:
    idx = PrefixIndex()
    for i, text in enumerate(prompts):
        idx.record(P(text), f"w{i % 3}", float(i))
    assert idx.branches_grow(P(trunk)[-1]) is expected
    assert idx.at(9.0).branches_grow(P(trunk)[-1]) is expected


@pytest.mark.parametrize("unseen", [True, False])
def test_a_fork_with_no_record_of_its_own_can_be_taken_as_told(unseen: bool) -> None:
    """Asked with ``unseen``, a fork with no record of its own is that, not the pool's; a
    fork with its own record answers from it either way."""
    idx = PrefixIndex()
    for i, text in enumerate(["SSSSAAAA", "SSSSBBBB", "SSSSBBBBbb", "TTTTAAAA", "TTTTBBBB"]):
        idx.record(P(text), f"w{i % 3}", float(i))
    assert idx.branches_grow(P("TTTT")[-1]) is True  # like the pool's forks: sessions
    assert idx.branches_grow(P("TTTT")[-1], unseen=unseen) is unseen
    assert idx.branches_grow(P("SSSS")[-1], unseen=unseen) is True


@pytest.mark.parametrize(("shared", "expected"), [(45, True), (40, False)])
def test_branches_grow_sees_an_extension_through_sparse_checkpoints(
    shared: int, expected: bool
) -> None:
    """Checkpoints every 4 blocks past 8, and the last block. A session's next turn (all 45
    blocks of the first turn, then more) shares the checkpoint at 44, and its next checkpoint
    (48) is past the first turn's end: it extended it. A request that shares 40 blocks of it
    and goes on differently has its next checkpoint (44) inside it: a reuse."""

    def key(text: str) -> tuple[list[int], list[int]]:
        depths = sorted({*range(1, 9), *range(12, len(text), 4), len(text)})
        full = P(text)
        return [full[d - 1] for d in depths], depths

    idx = PrefixIndex()
    first = "S" * 8 + "A" * 37  # 45 blocks, off the fork S * 8 found by the prompt before it
    for text in ("S" * 8 + "B" * 20, first, first[:shared] + "x" * 30):
        blocks, depths = key(text)
        idx.record(blocks, "w1", 0.0, depths)
    assert idx.branches_grow(P("S" * 8)[-1]) is expected


def test_fill_is_the_share_of_the_modelled_cache_in_use() -> None:
    index = PrefixIndex()
    index.set_capacity("w1", 8)
    assert index.fill("w1") == 0.0
    index.record((1, 2, 3, 4), "w1", 0.0)
    assert index.fill("w1") == 0.5
    index.record((5, 6, 7, 8, 9, 10), "w1", 1.0)  # 10 blocks into 8: full, the LRU evicted
    assert index.fill("w1") == 1.0
    assert index.at(1.0).fill("w1") == 1.0
    assert index.fill("unknown") == 0.0


def test_a_prompt_that_goes_on_from_inside_another_splits_the_holds_where_it_parts() -> None:
    """w1's prompt is one run of checkpoints; w2's parts from it after "abc". Each worker holds
    what it sent, the first three checkpoints are both workers', and evicting w1's whole prompt
    leaves w2's as it was."""
    index = PrefixIndex()
    index.record(P("abcdefgh"), "w1", 0.0)
    index.record(P("abcxyz"), "w2", 1.0)
    assert index.match(P("abcdefgh"), 1.0) == {"w1": 8, "w2": 3}
    assert index.match(P("abcxyz"), 1.0) == {"w2": 6, "w1": 3}
    assert index.branched(P("abc")[-1])
    assert not index.branched(P("abcdefgh")[-1])
    assert len(index) == 11  # a-b-c shared, d..h, x..z
    index.shed("w1", 1.0)
    assert index.match(P("abcdefgh"), 2.0) == {"w2": 3}
    assert index.match(P("abcxyz"), 2.0) == {"w2": 6}
    assert index.held_blocks("w1") == 0
    assert index.held_blocks("w2") == 6
    assert len(index) == 6


def test_a_long_prompt_goes_block_by_block_from_its_tail_as_far_as_the_limit_asks() -> None:
    index = PrefixIndex()
    index.set_capacity("w1", 20)
    index.record(P("s" * 10 + "a" * 6), "w1", 0.0)  # 16 blocks
    index.record(P("s" * 10 + "b" * 7), "w1", 1.0)  # 7 more: 23, three over
    # The least recently used leaf is the first prompt's end: three of its blocks go.
    assert index.match(P("s" * 10 + "a" * 6), 1.0) == {"w1": 13}
    assert index.held_blocks("w1") == 20
    assert index.last_use("w1", P("s" * 10 + "aaa")[-1]) == 1


def test_retain_leaves_a_parent_as_recent_as_its_newest_child() -> None:
    """The worker's cache was emptied but for "a": both prompts below it go, and "a", a
    leaf then, was last used by the newer of them (whatever order they were dropped in)."""
    for first, second in (("ax", "ay"), ("ay", "ax")):
        index = PrefixIndex()
        index.record(P(first), "w1", 0.0)
        index.record(P(second), "w1", 1.0)
        index.retain("w1", {P("a")[0]}.__contains__)
        assert index.match(P(first), 1.0) == {"w1": 1}
        assert index.last_use("w1", P("a")[0]) == 2


def test_random_records_and_evictions_keep_every_workers_hold_a_prefix() -> None:
    """Whatever is recorded and evicted, a worker matched to depth c holds the prompt's first
    c checkpoints and not the next one, holds no more blocks than its capacity, and a
    forgotten worker is matched nowhere."""
    import random

    rng = random.Random(7)
    index = PrefixIndex(capacity=40, ttl_s=30.0)
    workers = ["w1", "w2", "w3"]
    texts = [""]
    for step in range(3000):
        now = step * 0.05
        text = rng.choice(texts)[: rng.randrange(30)] + "".join(
            rng.choice("ab") for _ in range(rng.randrange(1, 8)))
        texts = [*texts[-40:], text]
        worker = rng.choice(workers)
        if step % 97 == 0:
            index.forget_worker(worker)
            assert all(worker not in index.match(P(t), now) for t in texts if t)
        index.record(P(text), worker, now)
        if step % 13 == 0:
            index.forget(worker, P(text), rng.randrange(len(text) + 1))
        for w in workers:
            assert index.held_blocks(w) <= 40
        probe = P(rng.choice(texts[1:]))
        for w, count in index.match(probe, now).items():
            assert index.holds(w, probe[count - 1])
            assert count == len(probe) or not index.holds(w, probe[count])


def test_ids_that_are_not_chained_hashes_are_recorded_as_far_as_they_form_a_path() -> None:
    """Keys of small integers (trace block ids, hand-written tests) need not form a tree: an
    id may come back under another parent or twice in one key. The index records each key as
    far as it is a path of the tree, stays within each worker's capacity and forgets a worker
    whole."""
    import random

    rng = random.Random(11)
    index = PrefixIndex(capacity=12)
    for step in range(2000):
        worker = f"w{rng.randrange(3)}"
        key = [rng.randrange(30) for _ in range(rng.randrange(1, 8))]
        index.record(key, worker, step * 0.1)
        assert index.held_blocks(worker) <= 12
        matched = index.match(key, step * 0.1)
        assert all(0 < count <= len(key) for count in matched.values())
        if step % 50 == 0:
            index.forget_worker(worker)
            assert worker not in index.match(key, step * 0.1)
    for worker in ("w0", "w1", "w2"):
        index.forget_worker(worker)
    assert len(index) == 0
