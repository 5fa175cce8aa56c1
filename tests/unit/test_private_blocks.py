"""The prefix index models a worker's cache less the blocks an engine keeps outside it for the
request it admits (the prompt's partial last block): with token-exact keys its predictions
then match a real paged prefix cache under pressure, request for request."""

from __future__ import annotations

import random

from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from worker.kvcache import PrefixCache, block_hashes

BLOCK = 4


def _mispredictions(private_blocks: int, size: int = 40) -> int:
    """Requests whose cached blocks the index predicted wrong, over 300 prompts sent one at a
    time to one engine of ``size`` blocks: 5 shared prefixes of 6 blocks, each with a unique
    tail that ends in a partial block, so the cache is always under pressure."""
    index = PrefixIndex()
    pool = WorkerPool(["http://127.0.0.1:9"], index, private_blocks=private_blocks)
    wid = pool.states()[0].worker.id
    pool.set_capacity(wid, size)
    engine = PrefixCache(num_blocks=size, block_size=BLOCK)
    rng = random.Random(7)
    prefixes = [[rng.randrange(10_000) for _ in range(6 * BLOCK)] for _ in range(5)]
    wrong = 0
    for i in range(300):
        tail = rng.choice([1, 2, 3, 5, 6, 7, 9, 10, 11])
        tokens = rng.choice(prefixes) + [rng.randrange(10_000) for _ in range(tail)]
        keys = block_hashes(tokens, BLOCK)
        predicted = index.match(keys, float(i)).get(wid, 0)
        allocation = engine.allocate(f"r{i}", tokens)
        wrong += predicted != allocation.matched_blocks
        index.record(keys, wid, float(i))
        engine.release(f"r{i}")
    return wrong


def test_the_index_counts_the_admitted_requests_own_block() -> None:
    assert _mispredictions(private_blocks=1) == 0
    assert _mispredictions(private_blocks=0) > 10  # an LRU of the full size keeps one too many


def test_the_reported_size_stays_and_the_model_is_one_block_less() -> None:
    index = PrefixIndex()
    pool = WorkerPool(["http://127.0.0.1:9"], index, private_blocks=1)
    wid = pool.states()[0].worker.id
    assert pool.model_size(wid) == 0  # size unknown
    pool.set_capacity(wid, 500)
    assert (pool.get(wid).capacity_blocks, index.capacity(wid), pool.model_size(wid)) == (
        500, 499, 499)
    plain = WorkerPool(["http://127.0.0.1:9"], PrefixIndex())
    plain.set_capacity(plain.states()[0].worker.id, 500)
    assert plain.model_size(plain.states()[0].worker.id) == 500
