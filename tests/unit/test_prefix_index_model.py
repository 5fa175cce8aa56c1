"""The prefix index against a plain model of each worker's cache, operation by operation.

:class:`PrefixIndex` keeps runs of checkpoints, leading holds on them, a heap of leaves per
worker and tails trimmed as one slice: fast, and easy to get subtly wrong. :class:`LruModel`
says what it must do in the plainest terms (a dict of held checkpoints per worker, the least
recently used leaf found by a scan, one checkpoint evicted at a time), and random sessions of
records, matches, forgets, capacity changes, restarts and expiry compare the two after every
operation: which checkpoints each worker holds, their last use, its blocks, and matches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from gateway.fingerprint import FingerprintOptions, Namespace, PrefixKey, fingerprint
from gateway.routing.prefix_index import PrefixIndex

# Small blocks and few dense checkpoints: short texts have sparse checkpoints too.
_OPTS = FingerprintOptions(block_chars=1, anchor_blocks=2, dense_blocks=4, checkpoint_ratio=2)
_WORKERS = ("w1", "w2", "w3")


@dataclass
class _Held:
    depth: int
    parent: int | None  # the checkpoint before it on the prompt's path (None: the first)
    seq: int  # last use, as the record's sequence number
    at: float  # last use, as the record's time


class LruModel:
    """Each worker an LRU of checkpoints: using a prefix uses its deepest checkpoint; the
    least recently used leaf goes first, and the checkpoint before it, once a leaf, is as
    recent as its own last use or that leaf's, whichever is later. Blocks held: each
    checkpoint's depth past its parent's. Entries not used for ``ttl_s`` expire, checked at
    most every ``ttl_s / 64``."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.default = capacity
        self.ttl_s = ttl_s
        self.capacity: dict[str, int] = {}
        self.held: dict[str, dict[int, _Held]] = {}
        self.seq = 0
        self.swept_at = float("-inf")

    def blocks(self, wid: str) -> int:
        held = self.held.get(wid, {})
        return sum(h.depth - (held[h.parent].depth if h.parent is not None else 0)
                   for h in held.values())

    def _leaves(self, wid: str) -> list[int]:
        held = self.held[wid]
        parents = {h.parent for h in held.values()}
        return [b for b in held if b not in parents]

    def _oldest(self, wid: str) -> int | None:
        leaves = self._leaves(wid)
        return min(leaves, key=lambda b: self.held[wid][b].seq) if leaves else None

    def _evict(self, wid: str, block: int) -> None:
        held = self.held[wid]
        gone = held.pop(block)
        if gone.parent is not None and all(h.parent != gone.parent for h in held.values()):
            up = held[gone.parent]  # a leaf now: as recent as the use evicted below it
            up.seq, up.at = max(up.seq, gone.seq), max(up.at, gone.at)

    def _trim(self, wid: str) -> None:
        limit = self.capacity.get(wid, self.default)
        while wid in self.held and self.blocks(wid) > limit:
            oldest = self._oldest(wid)
            assert oldest is not None
            self._evict(wid, oldest)

    def _expire(self, now: float) -> None:
        if now - self.swept_at < self.ttl_s / 64:
            return
        self.swept_at = now
        for wid in self.held:
            while (oldest := self._oldest(wid)) is not None and (
                    self.held[wid][oldest].at < now - self.ttl_s):
                self._evict(wid, oldest)

    def record(self, key: PrefixKey, wid: str, now: float) -> None:
        self._expire(now)
        self.seq += 1
        held = self.held.setdefault(wid, {})
        depths = key.depths or tuple(range(1, len(key.blocks) + 1))
        for i, block in enumerate(key.blocks):
            if block not in held:
                parent = key.blocks[i - 1] if i else None
                held[block] = _Held(depths[i], parent, self.seq, now)
        last = held[key.blocks[-1]]
        last.seq, last.at = self.seq, now
        self._trim(wid)

    def match(self, key: PrefixKey, now: float) -> dict[str, int]:
        self._expire(now)
        found = {}
        for wid, held in self.held.items():
            count = 0
            while count < len(key.blocks) and key.blocks[count] in held:
                count += 1
            if count:
                found[wid] = count
        return found

    def forget(self, wid: str, key: PrefixKey, keep: int) -> None:
        held = self.held.get(wid, {})
        for block in reversed(key.blocks[keep:]):
            if block not in held:
                continue
            if any(h.parent == block for h in held.values()):
                break  # something below it is held
            self._evict(wid, block)

    def set_capacity(self, wid: str, blocks: int) -> None:
        self.capacity[wid] = max(1, blocks)
        self._trim(wid)

    def forget_worker(self, wid: str) -> None:
        self.held.pop(wid, None)

    def evict_used_before(self, wid: str, seq: int, floor: int) -> None:
        while wid in self.held and self.blocks(wid) > floor:
            oldest = self._oldest(wid)
            if oldest is None or self.held[wid][oldest].seq > seq:
                break
            self._evict(wid, oldest)


def _agree(index: PrefixIndex, model: LruModel, known: set[int], probe: PrefixKey,
           now: float) -> None:
    for wid in _WORKERS:
        assert index.held_blocks(wid) == model.blocks(wid), wid
        held = model.held.get(wid, {})
        for block in known:
            assert index.holds(wid, block) == (block in held), (wid, block)
            assert index.last_use(wid, block) == (held[block].seq if block in held else 0)
    assert index.match(probe.blocks, now) == model.match(probe, now)


@pytest.mark.parametrize("seed", range(6))
def test_the_index_evicts_and_matches_as_a_plain_lru_model_does(seed: int) -> None:
    rng = random.Random(seed)
    capacity, ttl_s = rng.choice([(12, 5.0), (30, 20.0), (60, 1000.0)])
    index, model = PrefixIndex(capacity=capacity, ttl_s=ttl_s), LruModel(capacity, ttl_s)
    namespace = Namespace(tenant="t")
    texts = ["ab"]
    known: set[int] = set()
    now = 0.0
    for step in range(700):
        now += rng.choice((0.01, 0.05, 0.2)) if step % 50 else ttl_s / 2
        # Prompts that go on from one another, part from inside, or start afresh.
        base = rng.choice(texts)
        text = base[: rng.randrange(len(base) + 1)] + "".join(
            rng.choice("ab") for _ in range(rng.randrange(1, 12)))
        texts = [*texts[-30:], text]
        key = fingerprint(text, namespace, _OPTS)
        known.update(key.blocks)
        wid = rng.choice(_WORKERS)
        op = rng.random()
        if op < 0.8:
            index.record(key.blocks, wid, now, key.depths)
            model.record(key, wid, now)
        elif op < 0.88:
            keep = rng.randrange(len(key.blocks) + 1)
            index.forget(wid, key.blocks, keep)
            model.forget(wid, key, keep)
        elif op < 0.93:
            blocks = rng.randrange(1, 2 * capacity)
            index.set_capacity(wid, blocks)
            model.set_capacity(wid, blocks)
        elif op < 0.97:
            seq, floor = rng.randrange(model.seq + 1), rng.randrange(capacity)
            index.evict_used_before(wid, seq, floor)
            model.evict_used_before(wid, seq, floor)
        else:
            index.forget_worker(wid)
            model.forget_worker(wid)
        probe = fingerprint(rng.choice(texts), namespace, _OPTS)
        _agree(index, model, known, probe, now)
