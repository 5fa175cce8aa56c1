"""The rebalancer's decisions and the membership sync, on the embedded store."""

from __future__ import annotations

import json

from gateway.backends.base import CACHE_CAPACITY_TOKENS
from gateway.pool import WorkerPool
from gateway.rebalance import (
    GrowCapacity,
    RebalanceOptions,
    Rebalancer,
    Shed,
    ShrinkCapacity,
    action_from_json,
    action_to_json,
)
from gateway.routing.prefix_index import PrefixIndex
from gateway.store.base import CacheReport, HitCounters, WorkerRecord
from gateway.store.memory import MemoryStore
from gateway.sync import StoreSync

URLS = ("http://10.0.0.1:8001", "http://10.0.0.2:8001")
W1, W2 = "10.0.0.1:8001", "10.0.0.2:8001"


def _setup() -> tuple[MemoryStore, WorkerPool, PrefixIndex, Rebalancer]:
    store = MemoryStore()
    index = PrefixIndex()
    pool = WorkerPool(URLS, index)
    rebalancer = Rebalancer(store, pool, index, "g1", RebalanceOptions(min_predictions=10,
                                                                       min_requests=10))
    return store, pool, index, rebalancer


def _report(wid: str, inp: int, hit: int, pred: int) -> CacheReport:
    return CacheReport(worker_id=wid, tenant="t", input_tokens=inp, matched_tokens=hit,
                       predicted_tokens=pred)


async def test_mispredictions_shrink_the_modelled_capacity() -> None:
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 0, 80)] * 20)  # predicted hits, all missed
    actions = await rebalancer.step()
    assert [a.action for a in actions] == ["shrink_capacity"]
    assert actions[0].worker == W1
    assert index.capacity(W1) == 50  # all missed: halved, the most one round takes
    assert index.held_blocks(W1) == 50
    assert (await store.recent_actions(10))[0]["worker"] == W1


async def test_a_modest_share_of_misses_shrinks_by_at_least_the_factor() -> None:
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W1, 0.0)
    # 3 of 20 responses (15%) missed their predicted hit: a worker that holds a bit less
    # than it says; ordinary noise stays below the 10% threshold.
    await store.add_telemetry([_report(W1, 100, 0, 80)] * 3 + [_report(W1, 100, 80, 80)] * 17)
    actions = await rebalancer.step()
    assert [a.action for a in actions] == ["shrink_capacity"]
    assert index.capacity(W1) == 80
    await store.add_telemetry([_report(W1, 100, 0, 80)] * 1 + [_report(W1, 100, 80, 80)] * 19)
    assert await rebalancer.step() == []  # 5%: no action
    assert index.capacity(W1) == 80


async def test_capacity_grows_back_slowly_after_clean_rounds() -> None:
    store, pool, index, rebalancer = _setup()
    pool.set_capacity(W1, 100)
    index.record(list(range(100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 0, 80)] * 20)
    await rebalancer.step()
    assert index.capacity(W1) == 50
    capacities = []
    for _ in range(4):
        await store.add_telemetry([_report(W1, 100, 80, 80)] * 20)  # every prediction held
        await rebalancer.step()
        capacities.append(index.capacity(W1))
    assert capacities == [50, 50, 53, 56]  # 3 clean rounds first, then +5% a round


async def test_growing_back_is_logged_as_grow_capacity() -> None:
    store, pool, index, rebalancer = _setup()
    pool.set_capacity(W1, 100)
    index.record(list(range(100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 0, 80)] * 20)
    assert [a.action for a in await rebalancer.step()] == ["shrink_capacity"]
    kinds = []
    for _ in range(3):
        await store.add_telemetry([_report(W1, 100, 80, 80)] * 20)
        kinds += [a.action for a in await rebalancer.step()]
    assert kinds == ["grow_capacity"]
    logged = await store.recent_actions(10)
    assert [a["action"] for a in logged] == ["grow_capacity", "shrink_capacity"]
    assert logged[0]["blocks"] == index.capacity(W1) == 53
    assert {"id", "at", "worker", "blocks", "reason"} <= logged[0].keys()


async def test_logged_actions_of_other_versions() -> None:
    """A grow that an older replica logged as shrink_capacity still applies (both set the
    capacity); kinds or shapes this version does not know are skipped."""
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W2, 0.0)
    for entry in (
        {"id": "old:1:w2:grow", "action": "shrink_capacity", "worker": W2, "blocks": 70},
        {"id": "new:1", "action": "rebalance_more", "worker": W2, "blocks": 10},
        {"id": "bad:1", "action": "shed", "worker": W2, "fraction": "half"},
        {"action": "shed", "worker": W2, "fraction": 0.5},
    ):
        await store.log_action(entry, keep=10)
    assert await rebalancer.step() == []
    assert index.capacity(W2) == 70
    assert index.held_blocks(W2) == 70


def test_actions_round_trip_through_json() -> None:
    for action in (
        ShrinkCapacity("a:1", 1.5, W1, 10, "missed"),
        GrowCapacity("a:2", 2.5, W1, 12, "clean"),
        Shed("a:3", 3.5, W2, 0.25, "thrashing"),
    ):
        assert action_from_json(json.loads(json.dumps(action_to_json(action)))) == action


async def test_noise_in_a_low_hit_rate_is_not_thrashing() -> None:
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 8, 0)] * 20)  # hit rate 0.08
    assert await rebalancer.step() == []
    index.record(list(range(1000, 1100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 3, 0)] * 20)  # 0.03: half, but only -0.05
    assert await rebalancer.step() == []
    assert index.held_blocks(W1) == 200


async def test_correct_predictions_change_nothing() -> None:
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 80, 80)] * 20)
    assert await rebalancer.step() == []
    assert index.held_blocks(W1) == 100


async def test_thrashing_worker_sheds_its_oldest_prefixes() -> None:
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W1, 0.0)
    await store.add_telemetry([_report(W1, 100, 60, 0)] * 20)  # hit rate 0.6
    assert await rebalancer.step() == []
    index.record(list(range(1000, 1100)), W1, 0.0)  # its prefixes grow...
    await store.add_telemetry([_report(W1, 100, 5, 0)] * 20)  # ...while hits collapse
    actions = await rebalancer.step()
    assert [a.action for a in actions] == ["shed"]
    assert index.held_blocks(W1) == 150  # a quarter of 200 dropped
    assert "thrashing" in actions[0].reason


async def test_actions_apply_once() -> None:
    store, _, index, rebalancer = _setup()
    index.record(list(range(100)), W2, 0.0)
    await store.log_action({"id": "x:1", "action": "shed", "worker": W2, "fraction": 0.5,
                            "reason": "test"}, keep=10)
    await rebalancer.step()
    await rebalancer.step()
    assert index.held_blocks(W2) == 50


async def test_membership_weights_and_capacity_follow_the_registry() -> None:
    store = MemoryStore()
    index = PrefixIndex()
    pool = WorkerPool((), index)
    sync = StoreSync(store, pool, index, origin="g1", tokens_per_block=16.0, shares_state=False)
    await store.register_worker(WorkerRecord("a", "http://a:1", ("m",), 1000, 16), ttl_s=60)
    await store.register_worker(WorkerRecord("b", "http://b:1", ("m",), 2000, 16), ttl_s=60)
    await sync.sync_membership()
    assert {s.worker.id for s in pool.states()} == {"a", "b"}
    # Claims count once the workers' own probes confirm them.
    assert {s.worker.id: s.worker.weight for s in pool.states()} == {"a": 1.0, "b": 1.0}
    for wid, tokens in (("a", 16_000.0), ("b", 32_000.0)):
        pool.mark_up(wid, frozenset({"m"}), {CACHE_CAPACITY_TOKENS: tokens})
    await sync.sync_membership()
    weights = {s.worker.id: s.worker.weight for s in pool.states()}
    assert weights["b"] == 2 * weights["a"]
    assert index.capacity("a") == 1000  # 1000 blocks x 16 tokens / 16 tokens per block
    assert pool.models() == {"m"}
    await store.deregister_worker("a")
    await sync.sync_membership()
    # A missing entry alone does not remove a worker the probes still find alive...
    assert {s.worker.id for s in pool.states()} == {"a", "b"}
    pool.mark_down("a", "probe failed")
    await sync.sync_membership()
    # ...missing and down, it leaves.
    assert {s.worker.id for s in pool.states()} == {"b"}


def test_hit_counters_flag_mispredictions() -> None:
    counters = HitCounters()
    counters.add(_report(W1, 100, 10, 80))
    counters.add(_report(W1, 100, 70, 80))
    counters.add(_report(W1, 100, 0, 0))
    assert counters.as_dict() == {"requests": 3, "input_tokens": 300, "matched_tokens": 80,
                                  "predicted_tokens": 160, "mispredicted": 1}
