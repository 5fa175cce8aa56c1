"""The exact index: block sets built from events agree with the engine's own cache."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.contracts.kv_keys import chain_seed, engine_namespace, token_block_keys
from gateway.contracts.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)
from gateway.kvevents.index import ExactIndex, ExactMatcher, WorkerBlocks
from gateway.routing.prefix_index import PrefixIndex
from worker.kvcache import PrefixCache

BS = 4


class Recorder:
    """A CacheListener that keeps the events, as the worker's publisher would send them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def stored(
        self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], namespace: str
    ) -> None:
        extra = ((namespace,), *([None] * (len(hashes) - 1))) if namespace and parent is None \
            else None
        self.events.append(BlockStored(tuple(hashes), parent, tuple(tokens), BS,
                                       extra_keys=extra))

    def removed(self, hashes: Sequence[int]) -> None:
        self.events.append(BlockRemoved(tuple(hashes)))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def drain_into(self, blocks: WorkerBlocks) -> None:
        # Through the wire format, as a subscriber gets them.
        batch = decode_batch(encode_batch(EventBatch(0.0, tuple(self.events))))
        for event in batch.events:
            blocks.apply(event)
        self.events.clear()


def keys(tokens: Sequence[int], namespace: str = "") -> list[int]:
    return token_block_keys(tokens, BS, chain_seed("", namespace))


def test_keys_chain_and_namespace() -> None:
    a = keys([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # the partial block has no key
    assert keys([1, 2, 3, 4, 9, 9, 9, 9])[0] == a[0]
    assert keys([1, 2, 3, 4, 9, 9, 9, 9])[1] != a[1]
    assert keys([1, 2, 3, 4], "tenant")[0] != a[0]
    assert engine_namespace("t", "") == "t"
    assert engine_namespace("", "s") == "s"
    assert engine_namespace("t", "s") == "t\x1fs"


def test_events_replayed_give_the_engines_depth_for_every_prompt() -> None:
    rng = random.Random(5)
    cache = PrefixCache(num_blocks=40, block_size=BS)
    rec = Recorder()
    cache.listener = rec
    blocks = WorkerBlocks()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    checked = 0
    for i in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        ns = rng.choice(["", "", "tenant-a"])
        # What the gateway predicts for this prompt, before sending it:
        predicted = blocks.depth(keys(prompt, ns), now=0.0) * BS
        alloc = cache.allocate(f"r{i}", prompt, ns)
        assert predicted == alloc.matched_tokens
        checked += 1
        rec.drain_into(blocks)
        cache.release(f"r{i}")
        if i % 97 == 96:
            cache.flush()
            rec.drain_into(blocks)
            assert len(blocks) == 0
    assert checked == 300
    assert cache.evicted_blocks > 0  # eviction was exercised


def test_removed_and_cleared() -> None:
    blocks = WorkerBlocks()
    toks = list(range(12))
    k = keys(toks)
    blocks.apply(BlockStored((b"a", b"b", b"c"), None, tuple(toks), BS))
    assert blocks.depth(k, 0.0) == 3
    blocks.apply(BlockRemoved((b"b",)))
    assert blocks.depth(k, 0.0) == 1
    blocks.apply(AllBlocksCleared())
    assert blocks.depth(k, 0.0) == 0
    assert blocks.stats.cleared == 1


def test_child_of_an_unknown_parent_is_an_orphan() -> None:
    blocks = WorkerBlocks()
    blocks.apply(BlockStored((2,), 99, (1, 2, 3, 4), BS))
    assert len(blocks) == 0
    assert blocks.stats.orphans == 1


def test_bound_drops_oldest() -> None:
    blocks = WorkerBlocks(max_blocks=2)
    blocks.apply(BlockStored((1, 2, 3), None, tuple(range(12)), BS))
    assert len(blocks) == 2
    assert blocks.stats.dropped == 1


def test_pending_counts_until_confirmed_or_expired() -> None:
    blocks = WorkerBlocks(pending_ttl_s=5.0)
    k = keys(list(range(8)))
    blocks.sent(k, now=10.0)
    assert blocks.depth(k, 12.0) == 2
    assert blocks.depth(k, 16.0) == 0  # no event confirmed it in time
    blocks.sent(k, now=20.0)
    blocks.unsent(k)
    assert blocks.depth(k, 20.0) == 0
    blocks.sent(k, now=30.0)
    blocks.apply(BlockStored((1, 2), None, tuple(range(8)), BS))
    assert blocks.pending == 0
    assert blocks.depth(k, 100.0) == 2


def test_matcher_takes_live_workers_from_events_and_the_rest_from_the_model() -> None:
    model = PrefixIndex()
    exact = ExactIndex()
    k = keys(list(range(16)))
    model.record(k, "modelled", 0.0)
    model.record(k, "evented", 0.0)  # the model thinks so; the engine says otherwise
    exact.set_live("evented", True)
    exact.worker("evented").apply(BlockStored((1,), None, tuple(range(4)), BS))
    matcher = ExactMatcher(model.at(0.0), exact, now=0.0)
    assert matcher.match(k) == {"modelled": 4, "evented": 1}
    exact.set_live("evented", False)  # its feed is down: the model stands in
    assert ExactMatcher(model.at(0.0), exact, now=0.0).match(k) == {"modelled": 4, "evented": 4}


def test_a_prefix_evicted_everywhere_goes_back_to_its_modelled_home() -> None:
    model = PrefixIndex()
    exact = ExactIndex()
    k = keys(list(range(16)))
    model.record(k, "home", 0.0)  # it lived here; the engine has evicted it since
    exact.set_live("home", True)
    exact.worker("home")
    matcher = ExactMatcher(model.at(0.0), exact, now=0.0, floor=2)
    assert matcher.match(k) == {"home": 4}  # cold everywhere: the model names its home
    assert matcher.held("home", k) == 0  # ... and the prediction stays exact
    exact.worker("home").apply(BlockStored((1, 2), None, tuple(range(8)), BS))
    assert matcher.match(k) == {"home": 2}  # held again: the events' depth
    assert matcher.held("home", k) == 2


def queued_exactness(capacity_known: bool, seed: int = 3, ahead: int = 4) -> float:
    """A full engine cache and prompts sent ``ahead`` of the engine (they wait in its queue):
    the share of prompts whose cached tokens were predicted exactly at send time."""
    rng = random.Random(seed)
    cache = PrefixCache(num_blocks=48, block_size=BS)
    rec = Recorder()
    cache.listener = rec
    blocks = WorkerBlocks(pending_ttl_s=1e9)
    if capacity_known:
        blocks.capacity = 48
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(8, 28))] for _ in range(10)]
    queue: list[tuple[str, list[int], int]] = []
    exact = total = 0
    for i in range(400):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        k = keys(prompt)
        queue.append((f"r{i}", prompt, blocks.depth(k, 0.0) * BS))
        blocks.sent(k, 0.0, reserve=1)  # the engine runs one request at a time
        if len(queue) > ahead:  # the engine admits the oldest queued prompt
            rid, tokens, predicted = queue.pop(0)
            alloc = cache.allocate(rid, tokens, "")
            exact += predicted == alloc.matched_tokens
            total += 1
            cache.release(rid)
            rec.drain_into(blocks)
    assert cache.evicted_blocks > 0
    return exact / total


def test_sends_into_a_full_cache_anticipate_its_evictions() -> None:
    known, unknown = queued_exactness(True), queued_exactness(False)
    assert known > unknown
    assert known >= 0.93


def test_doomed_blocks_stop_counting_until_used_or_stored() -> None:
    blocks = WorkerBlocks(pending_ttl_s=5.0)
    blocks.capacity = 4
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    blocks.apply(BlockStored((1, 2), None, tuple(a), BS))
    blocks.apply(BlockStored((3, 4), None, tuple(b), BS))
    blocks.sent(keys(a), now=1.0)  # a is used again: b is now the oldest
    blocks.sent(keys(c), now=1.0)  # two new blocks into a full cache of four
    assert blocks.depth(keys(b), 2.0) == 0  # doomed
    assert blocks.depth(keys(a), 2.0) == 2
    assert blocks.depth(keys(c), 2.0) == 2  # pending
    assert blocks.depth(keys(b), 7.0) == 2  # no eviction came: the engine kept it
    blocks.sent(keys(c), now=10.0)
    blocks.apply(BlockStored((5, 6), None, tuple(c), BS))
    blocks.sent(keys(b), now=11.0)  # used again: it counts (pending until stored)
    assert blocks.depth(keys(b), 11.5) == 2
