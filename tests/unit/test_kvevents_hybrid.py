"""The hybrid view: the modelled index, corrected by the engine's events."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from gateway.contracts.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from gateway.kvevents.hybrid import Corrections, HybridMatcher
from gateway.kvevents.index import ExactIndex
from gateway.routing.prefix_index import PrefixIndex
from tests.unit.test_kvevents_index import BS, Recorder, keys
from worker.kvcache import PrefixCache

W = "w1"
PROMPT = list(range(16))  # four blocks
K = keys(PROMPT)


def stored(first: int, last: int) -> BlockStored:
    """BlockStored of blocks ``first..last`` (1-based) of PROMPT, engine hashes = block no."""
    parent = first - 1 if first > 1 else None
    tokens = tuple(PROMPT[(first - 1) * BS : last * BS])
    return BlockStored(tuple(range(first, last + 1)), parent, tokens, BS)


def removed(*blocks: int) -> BlockRemoved:
    return BlockRemoved(tuple(blocks))


@dataclass
class Gateway:
    """One gateway's model and event-fed index for one worker, as the source wires them."""

    model: PrefixIndex
    exact: ExactIndex

    @classmethod
    def new(cls) -> Gateway:
        model = PrefixIndex()
        exact = ExactIndex(settle_s=2.0, skew_s=0.05)
        exact.model_holds = model.holds
        exact.on_reset = model.retain
        exact.set_live(W, True)
        return cls(model, exact)

    def send(self, n: int, now: float) -> None:
        self.model.record(K[:n], W, now)
        self.exact.sent(W, K[:n], now)

    def done(self, n: int, now: float) -> None:
        self.exact.done(W, K[:n], now)

    def event(self, event: Event, now: float, ts: float | None = None) -> None:
        """``event`` arrives at ``now``, in a batch published at ``ts`` (default ``now``)."""
        blocks = self.exact.worker(W)
        blocks.begin_batch(now if ts is None else ts, now)
        blocks.apply(event, now)
        blocks.end_batch()

    def view(self, now: float = 100.0) -> HybridMatcher:
        return HybridMatcher(self.model.at(now), self.exact, now)


# Each case: what happens, in order (send N blocks / request done / an event published when
# it arrives / a "late" event, published at the time given with it / the model evicts), then
# how many leading blocks of PROMPT the worker holds in the hybrid view.
CASES: list[tuple[str, list[tuple[str, object, float]], int]] = [
    ("the model alone, no events", [("send", 4, 0.0)], 4),
    ("this gateway's own store events change nothing",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.05), ("done", 4, 0.1)], 4),
    ("a removal after the request ended drops the block and what follows",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.05), ("done", 4, 0.1),
      ("event", removed(3), 0.5)], 2),
    ("a removal while a request carrying the block is in flight is stale",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.01), ("send", 4, 0.02),
      ("event", removed(3), 0.05), ("done", 4, 0.1)], 4),
    ("a removal, then the gateway sends the block again: held",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.05), ("done", 4, 0.1),
      ("event", removed(3), 0.5), ("send", 4, 1.0)], 4),
    ("a removal, then the engine stores it again: held",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.05), ("done", 4, 0.1),
      ("event", removed(3), 0.5), ("event", stored(3, 4), 0.6)], 4),
    ("a removal of the first block leaves nothing",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.05), ("done", 4, 0.1),
      ("event", removed(1), 0.5)], 0),
    ("blocks someone else stored are added",
     [("event", stored(1, 3), 1.0)], 3),
    ("... and extend what the model holds",
     [("send", 2, 0.0), ("event", stored(1, 2), 0.05), ("done", 2, 0.1),
      ("event", stored(3, 4), 30.0)], 4),
    ("this gateway's own late store event does not undo the model's eviction",
     [("send", 4, 0.0), ("done", 4, 0.1), ("evict", 4, 0.2),
      ("late", (stored(1, 4), 0.08), 0.3)], 0),
    ("a store published after the request ended is someone else's",
     [("send", 4, 0.0), ("done", 4, 0.1), ("evict", 4, 0.2), ("event", stored(1, 4), 0.3)],
     4),
    ("a removal published before the request ended, then the store of its admission",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.01), ("done", 4, 0.1),
      ("late", (removed(3), 0.02), 0.3), ("late", (stored(3, 4), 0.03), 0.3)], 4),
    ("a removal published before the request ended, then nothing: a removal once the "
     "events pass the request's end",
     [("send", 4, 0.0), ("event", stored(1, 4), 0.01), ("done", 4, 0.1),
      ("late", (removed(3), 0.02), 0.3), ("event", removed(9), 0.4)], 2),
    ("a store of a block whose request ended longer ago than the events' lag is someone "
     "else's",
     [("send", 4, 0.0), ("done", 4, 0.1), ("evict", 4, 0.2), ("event", stored(1, 4), 9.0)],
     4),
    ("a block someone else stored, then removed: gone",
     [("event", stored(1, 4), 1.0), ("event", removed(2), 2.0)], 1),
    ("a block someone else stored, then sent by this gateway: the model keeps it",
     [("event", stored(1, 4), 1.0), ("send", 4, 2.0), ("done", 4, 2.1), ("evict", 4, 2.2)],
     0),
    ("AllBlocksCleared empties the view, the model's part included",
     [("send", 4, 0.0), ("done", 4, 0.1), ("event", AllBlocksCleared(), 0.5)], 0),
    ("AllBlocksCleared keeps what a request in flight carries (admitting it stores it)",
     [("send", 4, 0.0), ("event", AllBlocksCleared(), 0.05), ("done", 4, 0.1)], 4),
    ("AllBlocksCleared published before a request ended keeps its prompt",
     [("send", 2, 0.0), ("done", 2, 0.05), ("send", 4, 0.06), ("done", 4, 0.1),
      ("late", (AllBlocksCleared(), 0.08), 0.3)], 4),
    ("... and drops what only requests that ended before it carried",
     [("send", 4, 0.0), ("done", 4, 0.01), ("send", 2, 0.06), ("done", 2, 0.1),
      ("late", (AllBlocksCleared(), 0.08), 0.3)], 2),
    ("after a clear, stores by others count again",
     [("send", 4, 0.0), ("done", 4, 0.1), ("event", AllBlocksCleared(), 0.5),
      ("event", stored(1, 2), 0.6)], 2),
]


@pytest.mark.parametrize(("steps", "expected"), [(s, e) for _, s, e in CASES],
                         ids=[name for name, _, _ in CASES])
def test_merge_rules(steps: list[tuple[str, object, float]], expected: int) -> None:
    gw = Gateway.new()
    for op, arg, now in steps:
        if op == "send":
            assert isinstance(arg, int)
            gw.send(arg, now)
        elif op == "done":
            assert isinstance(arg, int)
            gw.done(arg, now)
        elif op == "evict":  # the model's LRU drops the prompt (its capacity ran out)
            assert isinstance(arg, int)
            gw.model.forget(W, K[:arg])
        elif op == "late":
            assert isinstance(arg, tuple)
            gw.event(arg[0], now, ts=arg[1])
        else:
            assert isinstance(arg, BlockStored | BlockRemoved | AllBlocksCleared)
            gw.event(arg, now)
    assert gw.view().held(W, K) == expected


def test_removals_of_blocks_the_model_does_not_hold_are_not_kept() -> None:
    gw = Gateway.new()
    gw.event(stored(1, 4), 1.0)  # someone else's
    gw.event(removed(1, 2, 3, 4), 2.0)
    fix = gw.exact.corrections(W)
    assert fix is not None
    assert not fix.gone
    assert not fix.foreign
    assert fix.stats.foreign == 4
    assert fix.stats.removed == 0


def test_a_worker_holding_only_foreign_blocks_is_a_candidate() -> None:
    gw = Gateway.new()
    gw.model.record(K[:1], "w2", 0.0)  # another worker the model knows
    gw.event(stored(1, 4), 1.0)  # someone else filled w1
    assert gw.view().match(K) == {"w2": 1, W: 4}


def _served(stored_at: float) -> Gateway:
    """A request sent at 0, whose 4 blocks the engine stored at ``stored_at``, ended at 0.1."""
    gw = Gateway.new()
    gw.send(4, 0.0)
    gw.event(stored(1, 4), stored_at)
    gw.done(4, 0.1)
    return gw


def _removal_in_doubt() -> Gateway:
    """A removal of block 3 published at 0.02 (before the request was admitted) arrives at
    0.3."""
    gw = _served(stored_at=0.01)
    gw.event(removed(3), 0.3, ts=0.02)
    return gw


def test_workers_without_live_events_keep_the_models_word() -> None:
    gw = _served(stored_at=0.05)
    gw.event(removed(2), 0.5)
    assert gw.view().held(W, K) == 1
    gw.exact.set_live(W, False)  # its feed is down: no corrections
    assert gw.view().held(W, K) == 4
    assert gw.view().match(K) == {W: 4}


def test_a_prefix_cold_everywhere_matches_its_modelled_home() -> None:
    gw = _served(stored_at=0.05)
    gw.event(removed(1), 0.5)
    view = HybridMatcher(gw.model.at(2.0), gw.exact, 2.0, floor=2)
    assert view.match(K) == {W: 4}  # its home, for siblings to go back to
    assert view.held(W, K) == 0  # ... while the prediction says it is cold


def test_a_removal_in_doubt_waits_for_the_events_to_pass_the_requests_end() -> None:
    # The engine removed block 3 before it admitted this gateway's request (published at
    # 0.02, arriving at 0.3 after the request ended at 0.1): in doubt until a batch published
    # after the request's end (+ skew) shows no store of it followed.
    gw = _removal_in_doubt()
    assert gw.view(0.3).held(W, K) == 4  # in doubt: the model's word stands
    gw.event(removed(9), 0.35, ts=0.12)  # not past the fence (0.1 + 0.05) yet
    assert gw.view(0.35).held(W, K) == 4
    gw.event(removed(9), 0.4, ts=0.2)
    assert gw.view(0.4).held(W, K) == 2
    fix = gw.exact.corrections(W)
    assert fix is not None
    assert fix.stats.removed == 1


def test_a_removal_in_doubt_counts_after_settle_s_when_the_feed_goes_quiet() -> None:
    gw = _removal_in_doubt()
    assert gw.view(1.0).held(W, K) == 4
    assert gw.view(2.5).held(W, K) == 2  # settle_s (2 s) after it arrived


def test_a_feed_reset_before_its_first_batch_leaves_the_model_alone() -> None:
    gw = Gateway.new()
    gw.send(4, 0.0)
    gw.done(4, 0.1)
    gw.exact.worker(W).clear()  # e.g. its first gap could not be replayed
    assert gw.view().held(W, K) == 4
    gw.event(stored(1, 4), 0.2, ts=0.05)  # its own store, late: not someone else's
    assert gw.view().held(W, K) == 4
    gw.event(removed(9), 0.5)  # a batch published after the request ended
    gw.exact.worker(W).clear()  # the events have spoken since: the model forgets
    assert gw.view().held(W, K) == 0


def test_retain_drops_the_rest_of_a_workers_prefixes() -> None:
    model = PrefixIndex()
    other = keys([9] * 8)
    model.record(K, W, 0.0)
    model.record(other, W, 0.0)
    model.record(K, "w2", 0.0)
    model.retain(W, set(K[:2]).__contains__)
    assert model.match(K, 1.0) == {W: 2, "w2": 4}
    assert model.match(other, 1.0) == {}
    assert model.held_blocks(W) == 2
    model.record(K, W, 2.0)  # recorded again from where it stands
    assert model.match(K, 2.0) == {W: 4, "w2": 4}
    assert model.held_blocks(W) == 4


def test_a_dropped_worker_leaves_the_foreign_map() -> None:
    gw = Gateway.new()
    gw.event(stored(1, 4), 1.0)
    assert gw.exact.foreign_holders(K[0]) == {W}
    gw.exact.drop(W)
    assert gw.exact.foreign_holders(K[0]) == set()


# -- a deterministic engine behind a lagging event feed ----------------------------------------


def simulate(seed: int, ahead: int = 4, lag: int = 3, others: bool = False) -> dict[str, float]:
    """One engine (a 48-block PrefixCache admitting one prompt at a time, FIFO) with prompts
    sent ``ahead`` of it; its events reach the gateway ``lag`` admissions late. With ``others``
    a second client sends its own prompts straight to the engine. Per view, the share of this
    gateway's prompts whose cached tokens were predicted exactly when they were sent."""
    rng = random.Random(seed)
    cache = PrefixCache(num_blocks=48, block_size=BS)
    rec = Recorder()
    cache.listener = rec
    model = PrefixIndex(capacity=47)  # one block held by the running request
    exact = ExactIndex(pending_ttl_s=0.5, settle_s=1.0, skew_s=0.001)
    exact.model_holds = model.holds
    exact.on_reset = model.retain
    exact.set_capacity(W, 48)
    exact.set_live(W, True)
    blocks = exact.worker(W)
    ours = [[rng.randrange(50) for _ in range(rng.randrange(8, 28))] for _ in range(10)]
    theirs = [[rng.randrange(50, 99) for _ in range(rng.randrange(8, 20))] for _ in range(3)]
    queue: list[tuple[str, list[int], list[int], dict[str, int] | None]] = []
    feed: list[tuple[float, list[Event]]] = []  # batches on their way to the gateway
    hits = {"model": 0, "events": 0, "hybrid": 0}
    total = 0
    now = 0.0

    def admit() -> None:
        nonlocal total
        rid, tokens, k, predicted = queue.pop(0)
        alloc = cache.allocate(rid, tokens, "")
        cache.release(rid)
        if predicted is not None:
            total += 1
            for view, p in predicted.items():
                hits[view] += p == alloc.matched_tokens
            exact.done(W, k, now)
        feed.append((now, list(rec.events)))
        rec.events.clear()
        while len(feed) > lag:
            ts, events = feed.pop(0)
            blocks.begin_batch(ts, now)
            for event in events:
                blocks.apply(event, now)
            blocks.end_batch()

    for i in range(600):
        now += 0.01
        if others and i % 3 == 0:  # another gateway: the same system prompts, and its own
            prompt = rng.choice(theirs + ours) + [rng.randrange(50, 99) for _ in range(3)]
            queue.append((f"o{i}", prompt, [], None))
        prompt = rng.choice(ours) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        k = keys(prompt)
        predicted = {
            "model": model.match(k, now).get(W, 0) * BS,
            "events": blocks.depth(k, now) * BS,
            "hybrid": HybridMatcher(model.at(now), exact, now).held(W, k) * BS,
        }
        queue.append((f"r{i}", prompt, k, predicted))
        model.record(k, W, now)
        exact.sent(W, k, now, reserve=1)
        while len(queue) > ahead:
            admit()
    assert cache.evicted_blocks > 0
    return {view: n / total for view, n in hits.items()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_gateway_hybrid_is_as_exact_as_the_model_and_beats_lagging_events(
    seed: int,
) -> None:
    share = simulate(seed)
    assert share["hybrid"] >= share["model"]
    assert share["hybrid"] > share["events"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_another_writer_the_hybrid_beats_the_model(seed: int) -> None:
    share = simulate(seed, others=True)
    assert share["hybrid"] > share["model"]


def test_simulation_reports_every_view(capsys: pytest.CaptureFixture[str]) -> None:
    shares: dict[str, list[float]] = {"alone": [], "others": []}
    for seed in (1, 2, 3):
        for name, others in (("alone", False), ("others", True)):
            s = simulate(seed, others=others)
            shares[name].append(s["hybrid"])
            print(name, seed, {k: round(v, 3) for k, v in s.items()})
    assert all(0.0 < v <= 1.0 for vs in shares.values() for v in vs)


def test_two_requests_with_one_key_sequence_are_both_in_flight() -> None:
    """The same key sequence object sent twice (a retry, a repeated prompt): when one has
    ended, a removal is still stale while the other is in flight."""
    gw = Gateway.new()
    prompt = K[:4]
    gw.model.record(prompt, W, 0.0)
    gw.exact.sent(W, prompt, 0.0)
    gw.exact.sent(W, prompt, 0.01)
    gw.event(stored(1, 4), 0.02)
    gw.exact.done(W, prompt, 0.05)
    gw.event(removed(3), 0.3)  # past the first one's end (+ skew); the second carries it
    assert gw.view(0.3).held(W, K) == 4
    fix = gw.exact.corrections(W)
    assert fix is not None
    assert fix.stats.kept == 1
    assert fix.inflight_requests == 1
    gw.exact.done(W, prompt, 0.4)
    assert fix.inflight_requests == 0


def test_requests_that_ended_are_kept_only_while_their_events_may_come() -> None:
    gw = Gateway.new()
    fix = gw.exact.corrections(W)
    assert fix is not None
    fix.max_ended = 3
    for i in range(5):
        gw.send(4, 0.1 * i)
        gw.done(4, 0.1 * i + 0.05)
    assert len(fix._ended) == 3  # the bound
    gw.event(stored(1, 4), 5.0)  # a batch published long after: their fences are passed
    assert len(fix._ended) == 0


@pytest.mark.parametrize("seed", range(5))
def test_depth_with_the_prompts_set_agrees_with_the_walk(seed: int) -> None:
    rng = random.Random(seed)
    fix = Corrections(W, {})
    prompt = [rng.getrandbits(60) for _ in range(300)]
    others = [rng.getrandbits(60) for _ in range(50)]
    for _ in range(200):
        fix.gone.clear()
        fix.foreign.clear()
        for k in rng.sample(others, rng.randint(0, 5)):
            (fix.gone if rng.random() < 0.5 else fix.foreign)[k] = None
        if rng.random() < 0.5:
            fix.gone[rng.choice(prompt)] = None
        if rng.random() < 0.3:
            fix.foreign[rng.choice(prompt)] = None
        modelled = rng.randint(0, len(prompt))
        walked = fix.depth(prompt, modelled, 0.0)
        assert fix.depth(prompt, modelled, 0.0, lambda: frozenset(prompt)) == walked
