"""The synthetic RAG trace generator and its CLI entry in the cluster simulator."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loadtest import simulate as cli
from loadtest.rag_trace import RagSpec, chain, rag_shape, rag_spec, rag_trace
from loadtest.traces import TraceRequest

SPEC = RagSpec(requests=400, tenants=4, chunks_per_tenant=32, topics_per_tenant=8, seed=7)


def test_rag_trace_is_deterministic_by_seed() -> None:
    a, b = rag_trace(SPEC), rag_trace(SPEC)
    assert a == b
    other = rag_trace(dataclasses.replace(SPEC, seed=8))
    assert [r.blocks for r in other.requests] != [r.blocks for r in a.requests]


def test_rag_trace_shape() -> None:
    trace = rag_trace(SPEC)
    assert len(trace.requests) == len(trace.content) == SPEC.requests
    n_blocks = SPEC.system_blocks + SPEC.retrieved * SPEC.chunk_blocks + SPEC.question_blocks
    for i, (req, content) in enumerate(zip(trace.requests, trace.content, strict=True)):
        assert isinstance(req, TraceRequest)
        assert req.index == i
        assert len(req.blocks) == len(content) == n_blocks
        assert (n_blocks - 1) * 512 < req.input_tokens <= n_blocks * 512
        assert req.output_tokens >= 1
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)


def test_chained_ids_share_exactly_the_common_prefix() -> None:
    sys_ids, a, b, c = [1, 2], [10, 11], [20, 21], [30, 31]
    x = chain([*sys_ids, *a, *b, *c])
    same_first = chain([*sys_ids, *a, *c, *b])
    reordered = chain([*sys_ids, *b, *a, *c])
    assert x[:4] == same_first[:4]
    assert x[4] != same_first[4]
    assert x[:2] == reordered[:2]
    assert x[2] != reordered[2]
    # a chunk at the same position after a different prefix is a different block
    assert set(x[2:]).isdisjoint(reordered[2:])
    assert chain([1, 2], seed=1) != chain([1, 2], seed=2)


def test_shuffle_and_noise_control_the_order() -> None:
    ordered = dataclasses.replace(SPEC, rank_noise=0.0, shuffle_share=0.0, topic_chunks=4)
    trace = rag_trace(ordered)
    shape = rag_shape(trace, ordered)
    # 4 tenants x 8 topics, always the same 4 chunks in the same order: the whole prefix repeats
    # for every request but the first of each (tenant, topic).
    assert shape.same_prefix >= 1 - 32 / ordered.requests
    assert shape.seen_content_new_order == 0.0
    shuffled = dataclasses.replace(ordered, shuffle_share=1.0)
    s_shape = rag_shape(rag_trace(shuffled), shuffled)
    assert s_shape.same_prefix < shape.same_prefix
    assert s_shape.seen_content_new_order > 0.3


def test_rag_spec_options() -> None:
    spec = rag_spec(10, seed=3, rate_per_s=5.0, options=["system_blocks=0", "rank_noise=0.5"])
    assert (spec.requests, spec.seed, spec.rate_per_s) == (10, 3, 5.0)
    assert (spec.system_blocks, spec.rank_noise) == (0, 0.5)
    for bad in ("nope=1", "system_blocks", "requests=4"):
        with pytest.raises(ValueError, match="bad RAG option"):
            rag_spec(10, options=[bad])
    with pytest.raises(ValueError, match="retrieved"):
        RagSpec(requests=1, retrieved=7, topic_chunks=6)


def test_cli_runs_a_rag_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--rag", "200", "--workers", "2", "--cache-blocks", "60",
                     "--policy", "cache_aware", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "cache_aware"
    assert out["trace"] == "rag(200, seed=0)"
    assert 0.0 < out["block_hit_rate"] <= 1.0
