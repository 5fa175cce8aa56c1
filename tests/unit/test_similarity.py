"""The RAG trace generator and the MinHash-LSH similarity hint (evaluation code, issue 6)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from gateway.routing.engine import Context
from gateway.routing.policies import PolicyOptions, build_engine
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import RouteRequest, Snapshot, Worker, WorkerView
from loadtest import simulate as cli
from loadtest.rag_trace import RagSpec, RagTrace, chain, rag_shape, rag_spec, rag_trace
from loadtest.sim import SimConfig
from loadtest.traces import TraceRequest, prefix_key

SPEC = RagSpec(requests=400, tenants=4, chunks_per_tenant=32, topics_per_tenant=8, seed=7)


# -- the RAG trace ---------------------------------------------------------------------------


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
    assert trace.content_by_key()[trace.requests[3].key] == trace.content[3]


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


def test_cli_runs_a_rag_trace_without_the_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--rag", "200", "--workers", "2", "--cache-blocks", "60",
                     "--policy", "cache_aware", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "cache_aware"
    assert out["trace"] == "rag(200, seed=0)"
    assert 0.0 < out["block_hit_rate"] <= 1.0


def test_cli_similarity_needs_a_rag_trace() -> None:
    with pytest.raises(SystemExit):
        cli.main(["--synthetic", "20", "--similarity"])


# -- the similarity hint (needs datasketch) ------------------------------------------------------


def _sim() -> Any:
    pytest.importorskip("datasketch")
    from loadtest.sim import similarity

    return similarity


def test_index_finds_similar_content_and_forgets_old_entries() -> None:
    sim = _sim()
    index = sim.SimilarityIndex(sim.SimilarityOptions(capacity=2))
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    a_reordered = [5, 6, 1, 2, 7, 8, 3, 4]
    disjoint = [100, 101, 102, 103, 104, 105, 106, 107]
    index.record(a, index.sketch(a), "w0")
    assert index.query(index.sketch(a_reordered)) == {"w0": 1.0}  # a set: order does not matter
    assert index.query(index.sketch(disjoint)) == {}
    index.record(a, index.sketch(a), "w0")  # a repeat refreshes, does not grow
    assert len(index) == 1
    index.record(disjoint, index.sketch(disjoint), "w1")
    index.record([200, 201, 202], index.sketch([200, 201, 202]), "w1")
    assert len(index) == 2
    assert index.query(index.sketch(a)) == {}  # the oldest entry was dropped


def _views(*inflight: int) -> tuple[WorkerView, ...]:
    return tuple(
        WorkerView(Worker(f"w{i}", f"sim://w{i}"), True, 1 if t else 0, t)
        for i, t in enumerate(inflight)
    )


def _request(ids: list[int]) -> RouteRequest:
    key = prefix_key(chain(ids), 512 * len(ids))
    return RouteRequest(key=key, model="m", cost_tokens=512 * len(ids) + 10,
                        prompt_tokens=512 * len(ids))


def test_scorer_modes() -> None:
    sim = _sim()
    content = [1, 2, 3, 4, 5, 6]
    request = _request(content)
    views = _views(0, 0, 0)
    snapshot = Snapshot(views, PrefixIndex().at(0.0), Ring({"w0": 1.0, "w1": 1.0, "w2": 1.0}))
    for mode in sim.MODES:
        index = sim.SimilarityIndex(sim.SimilarityOptions(mode=mode))
        index.record(content, index.sketch(content), "w1")
        scorer = sim.SimilarityScorer(index, lambda _r: content)
        cold = Context(request, snapshot, {})
        assert scorer.score(cold, views) == {"w0": 0.0, "w1": 1.0, "w2": 0.0}
        # w0 holds the deepest prefix alone: neither mode moves the request off it
        assert set(scorer.score(Context(request, snapshot, {"w0": 3, "w1": 2}), views).values()) \
            == {0.0}
        tied = scorer.score(Context(request, snapshot, {"w0": 2, "w1": 2}), views)
        assert tied == ({"w0": 0.0, "w1": 1.0, "w2": 0.0} if mode == "tiebreak"
                        else dict.fromkeys(tied, 0.0))


def test_router_steers_a_cold_reordered_prompt_to_the_similar_worker() -> None:
    sim = _sim()
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    second = [7, 8, 5, 6, 3, 4, 1, 2]  # same chunks, another order: a cold prefix
    contents = {_request(c).key: c for c in (first, second)}
    ring = Ring({"w0": 1.0, "w1": 1.0})
    plain = build_engine("cache_aware", PolicyOptions())
    router = sim.SimilarityRouter("cache_aware", sim.content_lookup(contents))
    idle = Snapshot(_views(0, 0), PrefixIndex().at(0.0), ring)
    chosen = router.route(_request(first), idle).worker_id
    other = "w1" if chosen == "w0" else "w0"
    # the chosen worker now has one request in flight: without the hint the least loaded wins
    busy = _views(4096, 0) if chosen == "w0" else _views(0, 4096)
    snapshot = Snapshot(busy, PrefixIndex().at(0.0), ring)
    assert plain.route(_request(second), snapshot).worker_id == other
    decision = router.route(_request(second), snapshot)
    assert decision.worker_id == chosen
    assert decision.reason.startswith("cold")
    assert "similar=1.00" in decision.reason
    assert router.steered == 1


def test_simulate_with_similarity_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    sim = _sim()
    spec = dataclasses.replace(SPEC, system_blocks=0)
    trace: RagTrace = rag_trace(spec)
    config = SimConfig(2, 60, "cache_aware")
    run = sim.simulate_with_similarity(list(trace.requests), trace.content_by_key(), config)
    assert run.result.policy == "cache_aware+similarity(cold)"
    assert run.result.requests == spec.requests
    assert 0 < run.steered <= spec.requests
    assert cli.main(["--rag", "200", "--rag-option", "system_blocks=0", "--workers", "2",
                     "--cache-blocks", "60", "--similarity", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "cache_aware+similarity(cold)"
    assert out["similarity_steered"] > 0
    assert out["trace"] == "rag(200, seed=0, system_blocks=0)"
    with pytest.raises(SystemExit):
        cli.main(["--rag", "20", "--policy", "oracle", "--similarity"])


def test_evaluation_cell() -> None:
    sim = _sim()
    workload = sim.Workload("tiny", (("system_blocks", 0),), 2, 60)
    labels = [v[0] for v in sim.VARIANTS]
    row = sim.evaluate_one(workload, 0, 150, labels.index("cache_aware+sim(cold)"))
    assert row["workload"] == "tiny"
    assert row["policy"] == "cache_aware+sim(cold)"
    assert sim.markdown_means([row]).count("\n") == 2
    assert "tiny" in sim.markdown_rows([row])
