"""The generated workload traces: deterministic, with the shapes their docstrings promise."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import pytest

from loadtest.trace_workloads import (
    TRACE_WORKLOADS,
    AgentSpec,
    SharedPromptSpec,
    agent_sessions_ids,
    shared_prompts,
    shared_prompts_ids,
    workload_lines,
    workload_trace,
)
from loadtest.traces import parse_mooncake_line


def test_shared_prompts_shape() -> None:
    spec = SharedPromptSpec(requests=500, prompts=5, prompt_blocks=6, suffix_blocks=2, seed=3)
    rows = list(shared_prompts_ids(spec))
    assert len(rows) == 500
    prefixes = Counter(tuple(ids[:6]) for _, _, ids in rows)
    assert len(prefixes) == 5  # every request starts with one of the 5 prompts
    assert min(prefixes.values()) > 50  # chosen uniformly
    suffixes = [tuple(ids[6:]) for _, _, ids in rows]
    assert all(len(s) == 2 for s in suffixes)
    seen = {b for p in prefixes for b in p}
    assert len(set(suffixes)) == 500  # each suffix unique ...
    assert not seen & {b for s in suffixes for b in s}  # ... and never part of a prompt
    times = [t for t, _, _ in rows]
    assert times == sorted(times)
    assert rows == list(shared_prompts_ids(spec))  # deterministic


def test_agent_sessions_shape() -> None:
    spec = AgentSpec(sessions=12, turns=(5, 9), max_blocks=60, start_blocks=20, prefix_blocks=8,
                     growth_blocks=(2, 4), idle_share=0.2, time_scale=10.0, seed=1)
    rows = list(agent_sessions_ids(spec))
    prefix = rows[0][2][:8]
    assert all(ids[:8] == prefix for _, _, ids in rows)  # one shared tool + system prefix
    times = [t for t, _, _ in rows]
    assert times == sorted(times)
    # Sessions: group each request under the session whose last context it extends.
    sessions: dict[int, list[list[int]]] = defaultdict(list)
    for _, _, ids in rows:
        owner = next((s for s, turns in sessions.items()
                      if ids[: len(turns[-1])] == turns[-1]), len(sessions))
        sessions[owner].append(ids)
    assert len(sessions) == 12
    for turns in sessions.values():
        assert len(turns[0]) == 20
        growth = [len(b) - len(a) for a, b in itertools.pairwise(turns)]
        assert all(2 <= g <= 4 for g in growth)
        assert len(turns) <= 9
        assert len(turns) >= 5 or len(turns[-1]) + 4 > 60  # cut short only by max_blocks
        assert max(len(t) for t in turns) <= 60
    assert rows == list(agent_sessions_ids(spec))


def test_default_agent_sessions_match_the_brief() -> None:
    rows = list(agent_sessions_ids(AgentSpec()))
    sizes = [len(ids) for _, _, ids in rows]
    assert min(sizes) == 40  # 20k tokens of 512-token blocks
    assert max(sizes) <= 400  # 200k tokens
    assert len(rows) > 80 * 30


def test_jsonl_lines_parse_back_to_the_same_trace() -> None:
    lines = list(workload_lines("shared-prompts", requests=50, seed=2))
    parsed = [parse_mooncake_line(line, i) for i, line in enumerate(lines)]
    direct = shared_prompts(SharedPromptSpec(requests=50, seed=2))
    assert [p.blocks for p in parsed] == [d.blocks for d in direct]
    with pytest.raises(ValueError, match="jsonl export"):
        next(workload_lines("chat"))


@pytest.mark.parametrize("name", [n for n in TRACE_WORKLOADS if n != "agent-sessions"])
def test_every_workload_is_a_deterministic_trace(name: str) -> None:
    a, b = workload_trace(name, 40, seed=5), workload_trace(name, 40, seed=5)
    assert len(a) == 40
    assert [r.blocks for r in a] == [r.blocks for r in b]
    assert [r.blocks for r in a] != [r.blocks for r in workload_trace(name, 40, seed=6)]
    with pytest.raises(ValueError, match="unknown workload"):
        workload_trace("nope")
