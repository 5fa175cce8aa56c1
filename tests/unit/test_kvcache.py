"""PrefixCache: hand-computed answers on tiny pools (block_size 4 unless stated)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from worker.kvcache import CacheFullError, PrefixCache, Priority, Reuse, block_hashes


def toks(start: int, n: int) -> list[int]:
    """``n`` distinct token ids starting at ``start``."""
    return list(range(start, start + n))


A12 = toks(100, 12)  # three full blocks
B8 = toks(200, 8)  # two full blocks
C8 = toks(300, 8)


def run(cache: PrefixCache, rid: str, tokens: list[int], namespace: str = "") -> None:
    """Allocate and release at once (a finished request)."""
    cache.allocate(rid, tokens, namespace)
    cache.release(rid)


# -- hits and misses -----------------------------------------------------------------------

Setup = Callable[[PrefixCache], None]


def nothing(cache: PrefixCache) -> None:
    pass


def seen_a12(cache: PrefixCache) -> None:
    run(cache, "a", A12)


def seen_a7(cache: PrefixCache) -> None:
    run(cache, "a", A12[:7])


def seen_a12_in_ns1(cache: PrefixCache) -> None:
    run(cache, "a", A12, "ns1")


def running_a12(cache: PrefixCache) -> None:
    cache.allocate("a", A12)


@pytest.mark.parametrize(
    ("setup", "query", "namespace", "expected"),
    [
        pytest.param(nothing, A12, "", 0, id="empty-cache-miss"),
        pytest.param(seen_a12, A12, "", 12, id="identical-prompt-hits-all-full-blocks"),
        pytest.param(seen_a12, A12[:10], "", 8, id="shorter-query-partial-block-not-counted"),
        pytest.param(seen_a12, [*A12, 1, 2, 3], "", 12, id="longer-query-hits-cached-prefix"),
        pytest.param(seen_a12, [*A12[:4], 999, *A12[5:]], "", 4, id="diverges-in-block-2"),
        pytest.param(seen_a12, [999, *A12[1:]], "", 0, id="diverges-in-block-1"),
        pytest.param(seen_a7, A12, "", 4, id="partial-last-block-never-cached"),
        pytest.param(seen_a12_in_ns1, A12, "", 0, id="default-namespace-misses-ns1"),
        pytest.param(seen_a12_in_ns1, A12, "ns2", 0, id="other-namespace-misses"),
        pytest.param(seen_a12_in_ns1, A12, "ns1", 12, id="same-namespace-hits"),
        pytest.param(running_a12, A12, "", 12, id="running-request-blocks-are-shared"),
        pytest.param(seen_a12, [], "", 0, id="empty-prompt"),
    ],
)
def test_lookup(setup: Setup, query: list[int], namespace: str, expected: int) -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    setup(cache)
    assert cache.lookup(query, namespace) == expected


def test_allocate_reports_matched_and_new_blocks() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    first = cache.allocate("a", A12[:10])  # 10 tokens: 2 full blocks + 1 partial
    assert (first.matched_blocks, first.matched_tokens, first.new_blocks) == (0, 0, 3)
    assert len(first.block_ids) == 3
    assert len(first.block_hashes) == 2
    assert first.uncached_tokens == 10
    cache.release("a")
    second = cache.allocate("b", A12[:10])
    assert (second.matched_blocks, second.matched_tokens, second.new_blocks) == (2, 8, 1)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.uncached_tokens == 2


def test_concurrent_requests_share_blocks_and_refcount() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    a = cache.allocate("a", A12)
    b = cache.allocate("b", A12)
    assert b.block_ids == a.block_ids
    assert cache.referenced_blocks == 3
    cache.release("a")
    assert cache.referenced_blocks == 3  # still held by b
    cache.release("b")
    assert (cache.referenced_blocks, cache.cached_blocks, cache.free_blocks) == (0, 3, 5)


def test_lookup_changes_nothing() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    run(cache, "a", A12)
    before = cache.stats()
    assert cache.lookup(A12) == 12
    assert cache.lookup(B8) == 0
    assert cache.stats() == before


# -- eviction ------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_chain() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    run(cache, "a", B8)  # blocks for B8
    run(cache, "c", C8)  # pool now full of cached content
    assert (cache.free_blocks, cache.cached_blocks) == (0, 4)
    run(cache, "a2", B8)  # touch B8: C8 is now least recently used
    run(cache, "d", toks(400, 8))  # needs 2 blocks: evicts C8's chain
    assert cache.lookup(B8) == 8
    assert cache.lookup(C8) == 0
    assert cache.lookup(toks(400, 8)) == 8
    assert cache.evicted_blocks == 2


def test_eviction_takes_the_deepest_block_of_a_chain_first() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    run(cache, "a", A12)  # 3 cached blocks, 1 free
    run(cache, "b", B8)  # needs 2: the free one + A12's last block
    assert cache.lookup(A12) == 8
    assert cache.lookup(B8) == 8


def test_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    cache.allocate("a", A12)  # running: 3 referenced blocks, 1 free
    before = cache.stats()
    with pytest.raises(CacheFullError):
        cache.allocate("b", B8)  # needs 2 new blocks, only 1 obtainable
    assert cache.stats() == before  # a failed allocation changes nothing
    assert cache.allocation("b") is None
    assert cache.lookup(A12) == 12
    cache.release("a")
    b = cache.allocate("b", B8)  # now A12's blocks are evictable
    assert b.new_blocks == 2
    assert cache.lookup(A12) == 8


def test_reusing_evictable_blocks_does_not_count_them_as_free() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    run(cache, "a", A12)  # 3 cached, 1 free
    # A12 + one more block: 3 matched (taken out of the evictable set) + 1 new = fits exactly.
    alloc = cache.allocate("b", [*A12, 1, 2, 3, 4])
    assert (alloc.matched_blocks, alloc.new_blocks) == (3, 1)
    with pytest.raises(CacheFullError):
        cache.allocate("c", [5])


def test_chain_with_missing_middle_reports_only_intact_leading_part() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    run(cache, "a", A12)
    h2 = block_hashes(A12, 4)[1]
    assert cache.discard(h2)
    assert cache.lookup(A12) == 4  # block 3 is still stored but unreachable
    again = cache.allocate("b", A12)
    assert (again.matched_blocks, again.new_blocks) == (1, 2)
    cache.release("b")
    assert cache.lookup(A12) == 12
    assert cache.used_blocks == 3  # the stale copy of block 3 was replaced, not duplicated
    assert not cache.discard(12345)


def test_discard_refuses_referenced_blocks() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    cache.allocate("a", A12)
    assert not cache.discard(block_hashes(A12, 4)[0])
    assert cache.lookup(A12) == 12


def test_clear_keeps_running_requests() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    run(cache, "a", B8)
    cache.allocate("b", A12)
    cache.clear()
    assert cache.lookup(B8) == 0
    assert cache.lookup(A12) == 12


# -- accounting ----------------------------------------------------------------------------


def test_counters_and_usage() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    cache.allocate("a", A12[:10])  # 10 queried, 0 hit, 3 blocks referenced
    assert cache.usage() == pytest.approx(3 / 8)
    assert cache.occupancy() == pytest.approx(3 / 8)
    cache.release("a")  # 2 full blocks stay cached, the partial one is freed
    assert cache.usage() == 0.0
    assert cache.occupancy() == pytest.approx(2 / 8)
    assert cache.used_blocks == 2
    cache.allocate("b", A12)  # 12 queried, 8 hit
    cache.lookup(A12)  # lookups are not counted
    assert (cache.queries_tokens, cache.hit_tokens) == (22, 8)
    stats = cache.stats()
    assert (stats.referenced_blocks, stats.cached_blocks, stats.free_blocks) == (3, 0, 5)
    assert stats.running_requests == 1


def test_request_ids_are_checked() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    cache.allocate("a", B8)
    with pytest.raises(ValueError, match="already holds"):
        cache.allocate("a", B8)
    cache.release("a")
    with pytest.raises(KeyError):
        cache.release("a")


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_blocks_needed(tokens: int, blocks: int) -> None:
    assert PrefixCache(num_blocks=8, block_size=4).blocks_needed(tokens) == blocks


def test_block_hashes_are_chained_and_namespaced() -> None:
    full = block_hashes(A12, 4)
    assert len(full) == 3
    assert block_hashes(A12[:8], 4) == full[:2]
    assert block_hashes(A12[:11], 4) == full[:2]  # partial block has no hash
    changed_first = block_hashes([0, *A12[1:]], 4)
    assert all(a != b for a, b in zip(changed_first, full, strict=True))  # chain propagates
    assert block_hashes(A12, 4, "x")[0] != full[0]
    assert block_hashes(A12, 4) == block_hashes(list(A12), 4)  # deterministic


# -- priority classes, reservations, flush -------------------------------------------------


def cached_set(cache: PrefixCache, *prompts: list[int]) -> list[int]:
    """Cached tokens found for each prompt."""
    return [cache.lookup(p) for p in prompts]


def test_untagged_eviction_is_plain_lru() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    run(cache, "b", B8)
    run(cache, "c", C8)
    run(cache, "d", toks(400, 4))  # evicts B8's deepest block (least recently released)
    assert cached_set(cache, B8, C8) == [4, 8]


@pytest.mark.parametrize(
    ("first", "second", "survivor"),
    [
        pytest.param(Priority.SYSTEM, Priority.CONVERSATION, "first", id="system-beats-newer-chat"),
        pytest.param(Priority.DOCUMENT, Priority.CONVERSATION, "first", id="document-beats-chat"),
        pytest.param(Priority.SYSTEM, Priority.DOCUMENT, "first", id="system-beats-document"),
        pytest.param(Priority.CONVERSATION, Priority.SYSTEM, "second", id="chat-goes-first"),
        pytest.param(Priority.DOCUMENT, Priority.DOCUMENT, "second", id="same-class-is-lru"),
    ],
)
def test_lower_priority_class_is_evicted_first(
    first: Priority, second: Priority, survivor: str
) -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    cache.allocate("b", B8, priority=first)
    cache.release("b")
    cache.allocate("c", C8, priority=second)
    cache.release("c")
    run(cache, "d", toks(400, 8))  # needs 2 blocks: one whole chain must go
    kept = B8 if survivor == "first" else C8
    gone = C8 if survivor == "first" else B8
    assert cached_set(cache, kept, gone) == [8, 0]


def test_system_tokens_tag_only_whole_blocks_inside_them() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    alloc = cache.allocate("a", A12, system_tokens=6)  # block 1 inside, block 2 straddles
    assert [cache.priority_of(b) for b in alloc.block_ids] == [
        Priority.SYSTEM, Priority.CONVERSATION, Priority.CONVERSATION,
    ]
    cache.release("a")
    assert cache.cached_blocks_by_priority() == {"conversation": 2, "document": 0, "system": 1}


def test_system_prompt_survives_pressure_from_conversations() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    run_sys = [*A12[:4], 1, 2, 3, 4]  # system block + one conversation block
    cache.allocate("s", run_sys, system_tokens=4)
    cache.release("s")
    for i in range(3):  # three later conversations, each 2 blocks, churn the pool
        run(cache, f"c{i}", toks(1000 + 100 * i, 8))
    assert cache.lookup(A12[:4]) == 4  # the system block was never a victim


def test_shared_block_keeps_the_highest_class() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    a = cache.allocate("a", B8, priority=Priority.DOCUMENT)
    cache.allocate("b", B8)  # conversation tag on the same blocks
    cache.release("a")
    cache.release("b")
    assert {cache.priority_of(b) for b in a.block_ids} == {Priority.DOCUMENT}


def test_priority_names_parse() -> None:
    assert Priority.parse("System") is Priority.SYSTEM
    with pytest.raises(ValueError, match="unknown cache priority"):
        Priority.parse("vip")


def test_reserved_slots_are_private_and_freed() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    alloc = cache.allocate("a", B8, reserve_tokens=5)  # 8 + 5 slots: 4 blocks
    assert (len(alloc.block_ids), alloc.new_blocks, alloc.reserved_tokens) == (4, 4, 5)
    assert len(alloc.block_hashes) == 2
    cache.release("a")
    assert (cache.cached_blocks, cache.free_blocks) == (2, 6)
    with pytest.raises(CacheFullError):
        cache.allocate("big", [1], reserve_tokens=40)


def test_flush_one_namespace_or_all() -> None:
    cache = PrefixCache(num_blocks=16, block_size=4)
    run(cache, "a", A12, "t1")
    run(cache, "b", A12, "t2")
    running = cache.allocate("c", B8, "t1")
    assert cache.flush("t1") == 5  # 3 cached + 2 referenced blocks
    assert (cache.lookup(A12, "t1"), cache.lookup(A12, "t2"), cache.lookup(B8, "t1")) == (0, 12, 0)
    assert cache.referenced_blocks == 2  # the running request keeps its blocks...
    cache.release("c")
    assert cache.referenced_blocks == 0
    assert cache.lookup(B8, "t1") == 0  # ...and they are freed, not cached, when it ends
    assert running.block_ids[0] not in {cache.allocate("x", A12, "t2").block_ids[0]}
    cache.release("x")
    assert cache.flush() == 3
    assert cache.used_blocks == 0


def test_forget_unregisters_a_requests_fresh_blocks() -> None:
    cache = PrefixCache(num_blocks=8, block_size=4)
    run(cache, "a", B8)
    cache.allocate("b", [*B8, *C8])
    cache.forget("b")
    assert cache.lookup([*B8, *C8]) == 8  # matched blocks stay; its own ones are gone
    cache.release("b")
    assert (cache.cached_blocks, cache.free_blocks) == (2, 6)
    with pytest.raises(KeyError):
        cache.forget("b")


def test_request_fields_map_to_priority_classes() -> None:
    from worker.errors import ApiError
    from worker.parsing import parse_chat, parse_completion

    body = {"model": "m", "prompt": "x", "cache_priority": "document"}
    assert parse_completion(body, "m").common.cache_priority is Priority.DOCUMENT
    assert parse_completion({"model": "m", "prompt": "x"}, "m").common.cache_priority is (
        Priority.CONVERSATION
    )
    with pytest.raises(ApiError, match="unknown cache priority"):
        parse_completion({**body, "cache_priority": "vip"}, "m")
    chat = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "rules"}, {"role": "developer", "content": "more"},
        {"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
    ]}, "m")
    assert chat.prompt.startswith(chat.system_prefix)
    assert chat.system_prefix.endswith("more<|end|>\n")
    assert "hi" not in chat.system_prefix


def test_blocks_are_reused_once_computed_when_asked() -> None:
    """With ``Reuse.COMPUTED`` (an engine that caches a prompt once its prefill is done), a
    request that shares a prefix another one is still prefilling computes it again; once
    that prefill is done, later requests reuse it; a request that ends before its prefill
    did leaves nothing cached."""
    cache = PrefixCache(num_blocks=16, block_size=4, reuse=Reuse.COMPUTED)
    tokens = list(range(12))
    assert cache.allocate("a", tokens).matched_blocks == 0
    assert cache.lookup(tokens) == 0  # a's prefill is not done
    assert cache.allocate("b", tokens).matched_blocks == 0
    cache.computed("a")
    assert cache.lookup(tokens) == 12
    assert cache.allocate("c", tokens).matched_blocks == 3
    for rid in ("a", "b", "c"):
        cache.release(rid)
    assert cache.lookup(tokens) == 12
    other = list(range(100, 112))
    cache.allocate("d", other)
    cache.release("d")  # ended before its prefill was done
    assert cache.lookup(other) == 0
    assert cache.allocate("e", other).matched_blocks == 0
    # Without it, a block is reused from its request's admission on.
    eager = PrefixCache(num_blocks=16, block_size=4)
    eager.allocate("a", tokens)
    assert eager.allocate("b", tokens).matched_blocks == 3


class _Heard:
    """A cache listener that keeps what it heard."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int],
               namespace: str) -> None:
        self.events.append(("stored", len(hashes)))

    def removed(self, hashes: Sequence[int]) -> None:
        self.events.append(("removed", len(hashes)))

    def cleared(self) -> None:
        self.events.append(("cleared", 0))


def test_blocks_reused_once_computed_are_announced_then() -> None:
    """A block is announced (BlockStored) when others may reuse it: under ``Reuse.COMPUTED``
    once its request's prefill is done, not at admission; a request that ends before its
    prefill did announces nothing and removes nothing. Under ``Reuse.ADMITTED``, at
    admission."""
    cache = PrefixCache(num_blocks=16, block_size=4, reuse=Reuse.COMPUTED)
    heard = cache.listener = _Heard()
    tokens = list(range(12))
    cache.allocate("a", tokens)
    assert heard.events == []
    cache.allocate("b", tokens)  # computes the same blocks privately: never announced
    cache.computed("a")
    assert heard.events == [("stored", 3)]
    cache.computed("b")
    assert heard.events == [("stored", 3)]
    cache.allocate("d", list(range(100, 112)))
    cache.release("d")  # ended before its prefill was done
    assert heard.events == [("stored", 3)]
    eager = PrefixCache(num_blocks=16, block_size=4)
    heard = eager.listener = _Heard()
    eager.allocate("a", tokens)
    assert heard.events == [("stored", 3)]


def test_the_copy_of_a_block_computed_first_is_the_one_cached() -> None:
    """Behind a request still computing a prompt (a long or low-priority prefill), another
    request computing the same prompt caches its own copy when it is done first, as an
    engine caches whichever copy of a block is computed first: later requests reuse it, the
    slow request's copy becomes private, and the content is announced once."""
    cache = PrefixCache(num_blocks=32, block_size=4, reuse=Reuse.COMPUTED)
    heard = cache.listener = _Heard()
    tokens = list(range(12))
    cache.allocate("slow", tokens)
    cache.allocate("quick", tokens)
    assert cache.lookup(tokens) == 0
    cache.computed("quick")
    assert cache.lookup(tokens) == 12
    assert cache.allocate("later", tokens).matched_blocks == 3
    cache.computed("slow")
    assert heard.events == [("stored", 3)]
    for rid in ("later", "quick", "slow"):
        cache.release(rid)
    assert cache.lookup(tokens) == 12
    assert cache.used_blocks == 3  # the slow request's copy was freed
    # The other way round: the first one's copy computed first stays the cached one.
    other = list(range(100, 108))
    cache.allocate("first", other)
    cache.allocate("second", other)
    cache.computed("first")
    cache.computed("second")
    cache.release("second")
    cache.release("first")
    assert cache.lookup(other) == 8
    assert heard.events[-1] == ("stored", 2)
    assert cache.used_blocks == 5


def test_blocks_are_reused_once_the_engine_begins_them_and_their_reusers_wait() -> None:
    """Under ``Reuse.SCHEDULED`` (vLLM caches a block when its tokens are scheduled): a
    request admitted before the engine began another's prefill computes the prefix again;
    once begun, the blocks are reusable and announced, and a request reusing them names the
    request still computing them (``awaits``) until it computed them."""
    cache = PrefixCache(num_blocks=32, block_size=4, reuse=Reuse.SCHEDULED)
    heard = cache.listener = _Heard()
    tokens = list(range(12))
    a = cache.allocate("a", tokens)
    assert (a.matched_blocks, a.awaits) == (0, ())
    assert cache.allocate("early", tokens).matched_blocks == 0  # a not begun yet
    assert heard.events == []
    cache.started("a")
    cache.started("a")  # idempotent
    assert heard.events == [("stored", 3)]
    assert cache.lookup(tokens) == 12
    b = cache.allocate("b", [*tokens, 50, 51, 52, 53])
    assert (b.matched_blocks, b.awaits) == (3, ("a",))
    cache.started("b")
    c = cache.allocate("c", [*tokens, 50, 51, 52, 53, 60])
    assert (c.matched_blocks, c.awaits) == (4, ("a", "b"))
    cache.computed("a")
    d = cache.allocate("d", tokens)
    assert (d.matched_blocks, d.awaits) == (3, ())
    assert heard.events == [("stored", 3), ("stored", 1)]


def test_a_request_ended_once_begun_leaves_its_blocks_cached() -> None:
    """Under ``Reuse.SCHEDULED`` a request given up after the engine began it leaves its
    blocks cached (the engine's step computes them); one given up before leaves nothing."""
    cache = PrefixCache(num_blocks=32, block_size=4, reuse=Reuse.SCHEDULED)
    heard = cache.listener = _Heard()
    begun, never = list(range(8)), list(range(100, 108))
    cache.allocate("begun", begun)
    cache.started("begun")
    cache.release("begun")
    cache.allocate("never", never)
    cache.release("never")
    assert (cache.lookup(begun), cache.lookup(never)) == (8, 0)
    assert cache.allocate("again", begun).awaits == ()
    assert heard.events == [("stored", 2)]


def test_the_copy_the_engine_begins_first_is_the_one_cached() -> None:
    """Under ``Reuse.SCHEDULED``, of two requests computing one prompt, the copy of the one
    the engine began first is cached (the other's stays private), whichever ends first."""
    cache = PrefixCache(num_blocks=32, block_size=4, reuse=Reuse.SCHEDULED)
    heard = cache.listener = _Heard()
    tokens = list(range(12))
    cache.allocate("waiting", tokens)  # e.g. a copy at a lower priority, not begun
    cache.allocate("quick", tokens)
    cache.started("quick")
    assert cache.allocate("later", tokens).awaits == ("quick",)
    cache.started("waiting")
    cache.computed("waiting")
    cache.computed("quick")
    assert heard.events == [("stored", 3)]
    for rid in ("later", "quick", "waiting"):
        cache.release(rid)
    assert cache.lookup(tokens) == 12
    assert cache.used_blocks == 3  # the copy begun later was private, and freed
