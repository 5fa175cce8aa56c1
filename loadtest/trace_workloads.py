"""Workload shapes as traces: shared system prompts, RAG, multi-turn chat, long agent sessions.

Each generator returns a list of :class:`~loadtest.traces.TraceRequest` (prompts as chains of
block ids, sizes in 512-token blocks, Mooncake units), deterministic by its seed, so one shape
feeds the simulator (:mod:`loadtest.simulate`), the live replay (:mod:`loadtest.replay`, each
block id one chunk of synthesized text: :mod:`loadtest.textgen`) and locust (the
``shared-prompts`` / ``agent-sessions`` user classes of ``loadtest/locustfile.py``) alike.
:func:`workload_lines` writes one as a Mooncake jsonl file.

* ``shared-prompts`` (:class:`SharedPromptSpec`): ``prompts`` system prompts of
  ``prompt_blocks`` blocks each, every request one of them (uniformly) plus ``suffix_blocks``
  unique blocks. With 64-character blocks the defaults are 20 shared ~2,000-character prompts
  plus a ~200-character unique suffix.
* ``rag``: retrieved document chunks in varying order (:mod:`loadtest.rag_trace`).
* ``chat``: multi-tenant multi-turn chat, conversations re-sent with each turn
  (:func:`loadtest.traces.synthetic_trace`).
* ``agent-sessions`` (:class:`AgentSpec`): long-context coding-agent sessions. Every session
  starts with one shared tool + system prefix (``prefix_blocks``: 20 blocks, ~10k tokens) and
  its own task context, 20k tokens in all, and each turn appends a few thousand tokens (the
  model's answer and tool results), up to ``max_blocks`` (400 blocks, ~200k tokens); a session
  has ``turns`` requests (30-80). Sessions start spread over ``start_window_s``; turns are
  ``think_s`` seconds apart, and with probability ``idle_share`` a gap of ``idle_s`` (minutes)
  comes first. ``time_scale`` divides every time (a benchmark replays minutes in seconds).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from loadtest.rag_trace import RagSpec, rag_trace
from loadtest.traces import (
    BLOCK_TOKENS,
    SyntheticSpec,
    TraceRequest,
    prefix_key,
    synthetic_trace,
    to_mooncake_lines,
)

TRACE_WORKLOADS = ("shared-prompts", "rag", "chat", "agent-sessions")


@dataclass(frozen=True, slots=True)
class SharedPromptSpec:
    requests: int = 2000
    prompts: int = 20
    prompt_blocks: int = 32
    suffix_blocks: int = 3
    output_tokens: int = 1
    rate_per_s: float = 50.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompts, self.prompt_blocks, self.suffix_blocks, self.output_tokens) < 1:
            raise ValueError("prompts, prompt_blocks, suffix_blocks, output_tokens must be >= 1")
        if self.requests < 0 or self.rate_per_s <= 0:
            raise ValueError("requests >= 0 and rate_per_s > 0 are required")


@dataclass(frozen=True, slots=True)
class AgentSpec:
    sessions: int = 96
    prefix_blocks: int = 20
    start_blocks: int = 40
    growth_blocks: tuple[int, int] = (4, 8)
    max_blocks: int = 400
    turns: tuple[int, int] = (30, 80)
    think_s: tuple[float, float] = (2.0, 10.0)
    idle_share: float = 0.05
    idle_s: tuple[float, float] = (120.0, 600.0)
    start_window_s: float = 120.0
    time_scale: float = 1.0
    output_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or not 0 <= self.prefix_blocks <= self.start_blocks:
            raise ValueError("sessions >= 1 and 0 <= prefix_blocks <= start_blocks are required")
        if self.start_blocks > self.max_blocks:
            raise ValueError("start_blocks must be <= max_blocks")
        for lo, hi in (self.growth_blocks, self.turns):
            if not 1 <= lo <= hi:
                raise ValueError("growth_blocks and turns need 1 <= low <= high")
        for flo, fhi in (self.think_s, self.idle_s):
            if not 0 <= flo <= fhi:
                raise ValueError("think_s and idle_s need 0 <= low <= high")
        if not 0.0 <= self.idle_share <= 1.0 or self.time_scale <= 0:
            raise ValueError("idle_share in [0, 1] and time_scale > 0 are required")


class _Ids:
    """Fresh block ids, counting up from ``start``."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def _request(index: int, arrival_s: float, ids: Sequence[int], output_tokens: int,
             rng: random.Random) -> TraceRequest:
    input_tokens = len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
    return TraceRequest(index, arrival_s, input_tokens, output_tokens,
                        prefix_key(ids, input_tokens))


def shared_prompts_ids(spec: SharedPromptSpec) -> Iterator[tuple[float, int, list[int]]]:
    """``(arrival_s, output_tokens, block ids)`` of each request of :func:`shared_prompts`."""
    rng = random.Random(f"{spec.seed}:shared-prompts")
    ids = _Ids()
    prompts = [ids.take(spec.prompt_blocks) for _ in range(spec.prompts)]
    now = 0.0
    for _ in range(spec.requests):
        now += rng.expovariate(spec.rate_per_s)
        yield now, spec.output_tokens, prompts[rng.randrange(spec.prompts)] + ids.take(
            spec.suffix_blocks)


def shared_prompts(spec: SharedPromptSpec) -> list[TraceRequest]:
    rng = random.Random(f"{spec.seed}:sizes")
    return [_request(i, t, ids, out, rng)
            for i, (t, out, ids) in enumerate(shared_prompts_ids(spec))]


def agent_sessions_ids(spec: AgentSpec) -> Iterator[tuple[float, int, list[int]]]:
    """``(arrival_s, output_tokens, block ids)`` of each request of :func:`agent_sessions`,
    in arrival order."""
    rng = random.Random(f"{spec.seed}:agent-sessions")
    ids = _Ids()
    prefix = ids.take(spec.prefix_blocks)
    # Per session: (next arrival, session, context so far, turns left).
    heap: list[tuple[float, int, list[int], int]] = []
    for s in range(spec.sessions):
        context = prefix + ids.take(spec.start_blocks - spec.prefix_blocks)
        start = rng.uniform(0.0, spec.start_window_s)
        heap.append((start, s, context, rng.randint(*spec.turns)))
    heapq.heapify(heap)
    while heap:
        at, s, context, left = heapq.heappop(heap)
        yield at / spec.time_scale, spec.output_tokens, context
        grown = context + ids.take(rng.randint(*spec.growth_blocks))
        if left <= 1 or len(grown) > spec.max_blocks:
            continue
        gap = rng.uniform(*spec.think_s)
        if rng.random() < spec.idle_share:
            gap += rng.uniform(*spec.idle_s)
        heapq.heappush(heap, (at + gap, s, grown, left - 1))


def agent_sessions(spec: AgentSpec) -> list[TraceRequest]:
    rng = random.Random(f"{spec.seed}:sizes")
    return [_request(i, t, ids, out, rng)
            for i, (t, out, ids) in enumerate(agent_sessions_ids(spec))]


def workload_trace(name: str, requests: int = 0, seed: int = 0) -> list[TraceRequest]:
    """The trace of workload ``name`` (:data:`TRACE_WORKLOADS`) with its default shape;
    ``requests`` > 0 sets the count (agent sessions: only the first ``requests``)."""
    if name == "shared-prompts":
        return shared_prompts(SharedPromptSpec(requests=requests or 2000, seed=seed))
    if name == "rag":
        return list(rag_trace(RagSpec(requests=requests or 4000, seed=seed)).requests)
    if name == "chat":
        return synthetic_trace(SyntheticSpec(requests=requests or 4000, seed=seed))
    if name == "agent-sessions":
        trace = agent_sessions(AgentSpec(seed=seed))
        return trace[:requests] if requests else trace
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(TRACE_WORKLOADS)}")


def workload_lines(name: str, requests: int = 0, seed: int = 0) -> Iterator[str]:
    """Mooncake jsonl lines of ``shared-prompts`` or ``agent-sessions`` (the shapes defined
    here; the others have their own modules)."""
    rows: Iterator[tuple[float, int, list[int]]]
    if name == "shared-prompts":
        rows = shared_prompts_ids(SharedPromptSpec(requests=requests or 2000, seed=seed))
    elif name == "agent-sessions":
        rows = agent_sessions_ids(AgentSpec(seed=seed))
    else:
        raise ValueError(f"jsonl export knows shared-prompts and agent-sessions, not {name!r}")
    rng = random.Random(f"{seed}:sizes")
    out = ((t, len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS), o, ids)
           for t, o, ids in rows)
    for i, line in enumerate(to_mooncake_lines(out)):
        if requests and i >= requests:
            return
        yield line
