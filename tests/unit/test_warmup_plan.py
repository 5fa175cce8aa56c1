"""Warm-up sources and the plan for a joining worker (pure code)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gateway.fingerprint import FingerprintOptions, PrefixKey
from gateway.normalize import NormalizeOptions
from gateway.routing.ring import Ring
from gateway.warmup_sources import (
    PlanOptions,
    PromptSample,
    WarmPrompt,
    load_warmup_file,
    parse_prompt,
    plan,
)

FP = FingerprintOptions()
NORM = NormalizeOptions()


def prompt(text: str, tenant: str = "t", uses: float = 1.0, pinned: bool = False) -> WarmPrompt:
    p = parse_prompt({"model": "m", "messages": [{"role": "system", "content": text}]},
                     default_model="m", normalize=NORM, fingerprint_options=FP, pinned=pinned)
    return dataclasses.replace(p, tenant=tenant, uses=uses)


def system_prompt(i: int, words: int = 80) -> str:
    return " ".join(f"rule{i}-{j}" for j in range(words))


def test_replay_body_is_prefill_only_with_the_same_messages() -> None:
    p = parse_prompt({"model": "m", "stream": True, "max_tokens": 300, "n": 2,
                      "messages": [{"role": "system", "content": "Be\u00a0brief.  "}]},
                     default_model="m", normalize=NORM, fingerprint_options=FP)
    body = p.replay_body()
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert "n" not in body
    assert body["messages"] == p.body["messages"]  # normalized exactly as real traffic
    assert body["messages"][0]["content"] != "Be\u00a0brief.  "


def test_a_responses_request_is_replayed_with_its_own_output_limit() -> None:
    key = PrefixKey((1, 2), 1, 128, (1, 2))
    prompt = WarmPrompt("/v1/responses", {"model": "m", "input": "hi", "stream": True,
                                          "max_output_tokens": 300}, "", "m", key)
    body = prompt.replay_body()
    assert body["max_output_tokens"] == 1
    assert "max_tokens" not in body
    assert body["stream"] is False
    assert body["input"] == "hi"


def test_plan_takes_only_anchors_the_ring_gives_the_worker_unless_hot() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 1.0, "new": 1.0}
    ring = Ring(weights)
    prompts = [prompt(system_prompt(i)) for i in range(40)]
    chosen = plan("new", prompts, weights, frozenset(), PlanOptions(ring_choices=1))
    owned = [p for p in prompts if ring.owner(p.key.anchor) == "new"]
    assert owned
    assert {p.key for p in chosen} == {p.key for p in owned}
    hot = prompt(system_prompt(99), uses=50.0)
    if ring.owner(hot.key.anchor) == "new":  # pick one the ring does not give to "new"
        hot = prompt(system_prompt(98), uses=50.0)
    assert ring.owner(hot.key.anchor) != "new"
    chosen = plan("new", [*prompts, hot], weights, frozenset(), PlanOptions(ring_choices=1))
    assert chosen[0].key == hot.key  # hot first: it will be spread to every new worker


def test_plan_orders_by_value_and_keeps_within_the_block_budget() -> None:
    weights = {"new": 1.0}
    prompts = [prompt(system_prompt(i), uses=float(i + 1)) for i in range(10)]
    pinned = prompt(system_prompt(50), pinned=True)
    each = len(prompts[0].key.blocks)
    chosen = plan("new", [*prompts, pinned], weights, frozenset(),
                  PlanOptions(budget_blocks=4 * each + len(pinned.key.blocks)))
    assert chosen[0].key == pinned.key
    assert [p.uses for p in chosen[1:]] == [10.0, 9.0, 8.0, 7.0]


def test_plan_skips_models_the_worker_does_not_serve() -> None:
    p = prompt(system_prompt(1), pinned=True)
    assert plan("new", [p], {"new": 1.0}, frozenset({"other"}), PlanOptions()) == []
    assert plan("new", [p], {"new": 1.0}, frozenset({"m"}), PlanOptions()) == [p]


def test_sample_is_opt_in_per_tenant_and_bounded() -> None:
    off = PromptSample()
    p = prompt(system_prompt(1))
    off.observe(p, now=0.0, name=p.tenant)
    assert len(off) == 0
    assert not off.enabled
    sample = PromptSample(tenants=frozenset({"t"}), per_tenant=3)
    for i in range(5):
        q = prompt(system_prompt(i))
        sample.observe(q, now=float(i), name="t")
        other = dataclasses.replace(q, tenant="other")
        sample.observe(other, now=float(i), name="other")  # not opted in
    assert len(sample) == 3
    assert {p.tenant for p in sample.prompts(5.0)} == {"t"}


def test_sample_counts_uses_per_anchor_with_decay() -> None:
    sample = PromptSample(tenants=frozenset({"*"}), half_life_s=10.0)
    p = prompt(system_prompt(1))
    for _ in range(4):
        sample.observe(p, now=0.0, name="")
    (entry,) = sample.prompts(0.0)
    assert entry.uses == pytest.approx(4.0)
    (entry,) = sample.prompts(10.0)
    assert entry.uses == pytest.approx(2.0)


def test_warmup_file_lines_are_parsed_and_bad_lines_named(tmp_path: Path) -> None:
    good = tmp_path / "warm.jsonl"
    good.write_text("# system prompts\n" + json.dumps(
        {"model": "m", "tenant": "abc", "messages": [{"role": "system", "content": "Hi"}]})
        + "\n\n" + json.dumps({"model": "m", "prompt": "Once upon"}) + "\n")
    prompts = load_warmup_file(str(good), normalize=NORM, fingerprint_options=FP)
    assert [p.path for p in prompts] == ["/v1/chat/completions", "/v1/completions"]
    assert prompts[0].tenant == "abc"
    assert all(p.pinned for p in prompts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"model": "m", "messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_warmup_file(str(bad), normalize=NORM, fingerprint_options=FP)
