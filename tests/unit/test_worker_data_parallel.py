"""The reference worker's data-parallel ranks, pure parts: the rank a header names, the choice of
the least loaded rank, each rank's KV-event endpoints, the totals of ``/stats`` and the settings
that refuse what cannot work."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.contracts.config import SettingsError
from worker.engines.base import EngineStats
from worker.kvcache import CacheStats
from worker.ranks import (
    RankPicker,
    least_loaded,
    load_score,
    parse_rank,
    rank_endpoint,
    total_by_key,
    total_stats,
)
from worker.settings import WorkerSettings
from worker.vllm_launcher import vllm_command


@pytest.mark.parametrize(("value", "size", "rank"), [
    ("0", 1, 0), ("1", 2, 1), ("3", 4, 3), ("007", 8, 7), ("63", 64, 63), ("000", 2, 0),
])
def test_a_header_names_a_rank(value: str, size: int, rank: int) -> None:
    assert parse_rank(value, size) == rank


@pytest.mark.parametrize(("value", "size"), [
    ("1", 1), ("2", 2), ("x", 2), ("-1", 2), ("+1", 2), ("1.5", 2), ("", 2), (" 1", 2),
    ("0x1", 2), ("1e0", 2), ("\u0661", 2),  # an Arabic-Indic one
    ("9" * 5000, 2), ("64", 64),
])
def test_a_header_that_names_no_rank_is_refused(value: str, size: int) -> None:
    with pytest.raises(ValueError, match=f"X-data-parallel-rank header must be an integer "
                                         f"from 0 to {size - 1}"):
        parse_rank(value, size)


def test_the_score_weighs_waiting_four_times_running() -> None:
    assert load_score(_stats(running=3, waiting=0)) == 3
    assert load_score(_stats(running=1, waiting=2)) == 9


@pytest.mark.parametrize(("scores", "start", "chosen"), [
    ([0, 0, 0], 0, 0),
    ([0, 0, 0], 2, 2),
    ([1, 0, 0], 0, 1),
    ([0, 1, 0], 1, 2),  # the tie after the start, wrapping around
    ([5, 4, 9], 2, 1),
    ([3], 0, 0),
])
def test_the_least_loaded_rank_wins_ties_from_the_start(
    scores: list[int], start: int, chosen: int,
) -> None:
    assert least_loaded(scores, start) == chosen


def test_idle_ranks_take_requests_in_turn_and_load_overrides_the_turn() -> None:
    picker = RankPicker(3)
    assert [picker.pick([0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    # Rank 1 is next in turn, but rank 2 is less loaded.
    assert picker.pick([2, 1, 0]) == 2
    # The turn goes on after the rank chosen last.
    assert picker.pick([0, 0, 0]) == 0
    with pytest.raises(ValueError, match="expected 3 scores"):
        picker.pick([0, 0])
    with pytest.raises(ValueError, match="size must be >= 1"):
        RankPicker(0)


def test_each_rank_binds_the_ports_plus_its_rank() -> None:
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("ipc:///run/kv", 2) == "ipc:///run/kv_dp2"
    assert rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert rank_endpoint("ipc:///run/kv", 0) == "ipc:///run/kv"
    assert rank_endpoint("", 5) == ""
    assert rank_endpoint("tcp://h:65534", 1) == "tcp://h:65535"
    with pytest.raises(ValueError, match="no port for data-parallel rank 2"):
        rank_endpoint("tcp://h:65534", 2)
    with pytest.raises(ValueError, match="no port"):
        rank_endpoint("tcp://h:*", 1)


def _stats(*, running: int = 0, waiting: int = 0, blocks: int = 64, referenced: int = 0,
           used: int = 0, queries: int = 0, hits: int = 0, finished: int = 0,
           prefill_s: float = 0.0) -> EngineStats:
    cache = CacheStats(
        num_blocks=blocks, block_size=16, free_blocks=blocks - used,
        referenced_blocks=referenced, cached_blocks=used - referenced, used_blocks=used,
        usage=referenced / blocks, occupancy=used / blocks, queries_tokens=queries,
        hit_tokens=hits, evicted_blocks=finished // 2, running_requests=running,
    )
    return EngineStats(
        running=running, waiting=waiting, max_running=8, requests_admitted=finished + running,
        requests_finished=finished, prompt_tokens=queries, generation_tokens=finished * 3,
        prefill_seconds=prefill_s, decode_seconds=prefill_s / 2, cache=cache,
    )


def test_the_totals_sum_the_ranks_and_recompute_the_fractions() -> None:
    a = _stats(running=2, waiting=1, blocks=64, referenced=8, used=40, queries=500, hits=100,
               finished=7, prefill_s=1.5)
    b = _stats(running=1, waiting=0, blocks=32, referenced=16, used=20, queries=300, hits=260,
               finished=4, prefill_s=0.25)
    total = total_stats([a, b])
    assert (total.running, total.waiting, total.max_running) == (3, 1, 16)
    assert (total.requests_admitted, total.requests_finished) == (14, 11)
    assert (total.prompt_tokens, total.generation_tokens) == (800, 33)
    assert total.prefill_seconds == pytest.approx(1.75)
    assert total.decode_seconds == pytest.approx(0.875)
    cache = total.cache
    assert (cache.num_blocks, cache.block_size, cache.free_blocks) == (96, 16, 36)
    assert (cache.referenced_blocks, cache.cached_blocks, cache.used_blocks) == (24, 36, 60)
    assert (cache.queries_tokens, cache.hit_tokens) == (800, 360)
    assert (cache.evicted_blocks, cache.running_requests) == (5, 3)
    assert cache.usage == pytest.approx(24 / 96)  # not the mean of 0.125 and 0.5
    assert cache.occupancy == pytest.approx(60 / 96)
    assert total_stats([a]) == a
    with pytest.raises(ValueError, match="no ranks"):
        total_stats([])


def test_blocks_by_priority_are_summed_per_key() -> None:
    assert total_by_key([
        {"system": 1, "document": 0, "conversation": 5},
        {"system": 2, "document": 3, "conversation": 0},
    ]) == {"system": 3, "document": 3, "conversation": 5}


def test_the_size_is_checked() -> None:
    assert WorkerSettings().data_parallel_size == 1
    assert WorkerSettings(data_parallel_size=64).data_parallel_size == 64
    for bad in (0, -1, 65):
        with pytest.raises(SettingsError, match="data_parallel_size must be from 1 to 64"):
            WorkerSettings(data_parallel_size=bad)


def test_every_rank_needs_its_event_ports() -> None:
    ok = WorkerSettings(data_parallel_size=2, kv_events="tcp://*:65534",
                        kv_replay="tcp://*:5600")
    assert ok.kv_events == "tcp://*:65534"
    with pytest.raises(SettingsError, match="no port for data-parallel rank 2"):
        WorkerSettings(data_parallel_size=3, kv_events="tcp://*:65534")
    with pytest.raises(SettingsError, match="no port for data-parallel rank 1"):
        WorkerSettings(data_parallel_size=2, kv_events="tcp://*:5557",
                       kv_replay="tcp://*:65535")
    # One rank keeps the endpoint as given.
    assert WorkerSettings(kv_events="tcp://*:65535").kv_events == "tcp://*:65535"
    # Rank 1's events would be rank 0's replay.
    with pytest.raises(SettingsError, match="leave 2 ports between them"):
        WorkerSettings(data_parallel_size=2, kv_events="tcp://*:5557", kv_replay="tcp://*:5558")
    assert WorkerSettings(kv_events="tcp://*:5557", kv_replay="tcp://*:5558").kv_replay


def test_vllm_is_started_with_the_ranks() -> None:
    one = vllm_command(WorkerSettings(engine="vllm"), ["m"])
    assert "--data-parallel-size" not in one
    settings = dataclasses.replace(WorkerSettings(engine="vllm"), data_parallel_size=4)
    cmd = vllm_command(settings, ["m"])
    assert cmd[cmd.index("--data-parallel-size") + 1] == "4"
    given = vllm_command(settings, ["m", "--data-parallel-size=2"])
    assert given.count("--data-parallel-size=2") == 1
    assert "--data-parallel-size" not in given
