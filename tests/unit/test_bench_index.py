"""loadtest.bench_index: the index's cost per request, beside another revision's."""

from __future__ import annotations

from pathlib import Path

import pytest

import gateway.routing.prefix_index as prefix_index
from loadtest.bench_index import (
    load_index,
    long_keys,
    main,
    mooncake_keys,
    one_pass,
    shared_keys,
)


def test_a_baseline_module_is_loaded_as_a_class_of_its_own_that_routes_alike() -> None:
    baseline = load_index(Path(prefix_index.__file__))
    assert baseline is not prefix_index.PrefixIndex
    keys, workers = mooncake_keys(4)
    ours, theirs = prefix_index.PrefixIndex(capacity=50), baseline(capacity=50)
    for i, (key, worker) in enumerate(zip(keys[:300], workers[:300], strict=True)):
        ours.record(key.blocks, worker, i * 0.05)
        theirs.record(key.blocks, worker, i * 0.05)
    assert len(ours) == len(theirs) > 0
    assert [ours.match(k.blocks, 15.0) for k in keys[:300]] == [
        theirs.match(k.blocks, 15.0) for k in keys[:300]]
    assert one_pass(baseline, keys[:100], workers[:100], 50) > 0.0


def test_long_prompts_are_new_and_sparse(capsys: pytest.CaptureFixture[str]) -> None:
    keys, workers = long_keys(20_000)
    assert len({k.blocks[0] for k in keys}) == len(keys)  # none shares a first block
    assert len(keys[0].blocks) < 20_000 // 64  # sparse checkpoints past the dense ones
    assert set(workers) == {"w1"}
    assert main(["--cache-blocks", "500", "--long", "3200", "--passes", "1",
                 "--shared-workers", "0", "--baseline", prefix_index.__file__]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].endswith("| ratio |")
    assert len(table) == 4  # header, rule, Mooncake, one long size
    assert table[3].startswith("| first-seen 3,200 characters")


def test_every_request_of_the_wide_fleet_shares_its_system_prompt() -> None:
    keys, workers = shared_keys(8, requests=50)
    assert len({k.blocks[29] for k in keys}) == 1  # the 30th block: the shared prompt's end
    assert len({k.blocks[-1] for k in keys}) == 50
    assert all(k.total_blocks == 50 for k in keys)
    assert set(workers) <= {f"w{i}" for i in range(8)}
