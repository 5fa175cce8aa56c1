"""A synthetic RAG workload: overlapping content in varying order (sizes in 512-token blocks).

The shape a content-similarity routing hint would be meant for: many prompts share most of
their *content* (the same retrieved chunks) but not their *prefix* (the chunks come in a
different order), and a worker's KV cache (like vLLM's) only reuses an exact prefix.

Per tenant: a system prompt of ``system_blocks`` blocks, a pool of ``chunks_per_tenant``
document chunks of ``chunk_blocks`` blocks each, and ``topics_per_tenant`` topics, each a ranked
list of ``topic_chunks`` chunks drawn from the pool (topics may share chunks). A request picks a
tenant (Zipf, ``tenant_skew``) and one of its topics (Zipf, ``topic_skew``), retrieves
``retrieved`` of the topic's chunks ranked by relevance with noise (rank + N(0, ``rank_noise``)),
so the same topic often but not always gives the same order, and with probability
``shuffle_share`` presents them in a random order instead (a retriever that sorts by document
position, a reranker, "lost in the middle" reordering). The prompt is::

    system blocks + chunk blocks (in that order) + question_blocks fresh blocks

Block ids are *chained* like Mooncake's (``loadtest/traces.py``): the id of a block depends on
the whole prefix before it, so a chunk at the same position after a different chunk is a
different block, and only an exact common prefix is reusable. The unchained *content* ids of
each request (one per block: the same chunk has the same ids wherever it sits) are kept beside
the trace, for :func:`rag_shape` (how much reuse is prefix reuse). Deterministic by ``seed``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from gateway.fingerprint import FingerprintOptions
from loadtest.traces import BLOCK_TOKENS, TraceRequest, prefix_key

_MASK_62 = (1 << 62) - 1


@dataclass(frozen=True, slots=True)
class RagSpec:
    """Parameters of :func:`rag_trace` (see the module docstring)."""

    requests: int
    tenants: int = 16
    system_blocks: int = 4
    chunks_per_tenant: int = 256
    chunk_blocks: int = 2
    topics_per_tenant: int = 64
    topic_chunks: int = 6
    retrieved: int = 4
    rank_noise: float = 1.0
    shuffle_share: float = 0.3
    question_blocks: int = 1
    tenant_skew: float = 0.8
    topic_skew: float = 1.0
    output_tokens: int = 256
    rate_per_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 0 or self.tenants < 1 or self.system_blocks < 0:
            raise ValueError("requests >= 0, tenants >= 1 and system_blocks >= 0 are required")
        if self.chunk_blocks < 1 or self.question_blocks < 1 or self.topics_per_tenant < 1:
            raise ValueError("chunk_blocks, question_blocks and topics_per_tenant must be >= 1")
        if not 1 <= self.retrieved <= self.topic_chunks <= self.chunks_per_tenant:
            raise ValueError("1 <= retrieved <= topic_chunks <= chunks_per_tenant is required")
        if not 0.0 <= self.shuffle_share <= 1.0 or self.rank_noise < 0.0:
            raise ValueError("shuffle_share must be in [0, 1] and rank_noise >= 0")
        if self.rate_per_s <= 0.0:
            raise ValueError("rate_per_s must be > 0")


@dataclass(frozen=True, slots=True)
class RagTrace:
    """The requests (simulator input) and, by request index, each one's unchained content ids."""

    requests: tuple[TraceRequest, ...]
    content: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class _Tenant:
    system: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    topics: tuple[tuple[int, ...], ...]  # ranked chunk indexes


def chain(content: Sequence[int], seed: int = 0) -> list[int]:
    """Prefix-chained block ids: id ``i`` depends on content ids ``0..i`` (order included)."""
    out: list[int] = []
    h = seed
    for c in content:
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + c.to_bytes(8, "little")) & _MASK_62
        out.append(h)
    return out


def rag_trace(spec: RagSpec, opts: FingerprintOptions | None = None) -> RagTrace:
    """A deterministic RAG trace (see :class:`RagSpec`)."""
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh(n: int) -> tuple[int, ...]:
        nonlocal next_id
        ids = tuple(range(next_id, next_id + n))
        next_id += n
        return ids

    tenants: list[_Tenant] = []
    for _ in range(spec.tenants):
        system = fresh(spec.system_blocks)
        chunks = tuple(fresh(spec.chunk_blocks) for _ in range(spec.chunks_per_tenant))
        topics = tuple(
            tuple(rng.sample(range(spec.chunks_per_tenant), spec.topic_chunks))
            for _ in range(spec.topics_per_tenant)
        )
        tenants.append(_Tenant(system, chunks, topics))
    tenant_weights = [1.0 / (t + 1) ** spec.tenant_skew for t in range(spec.tenants)]
    topic_weights = [1.0 / (t + 1) ** spec.topic_skew for t in range(spec.topics_per_tenant)]

    requests: list[TraceRequest] = []
    contents: list[tuple[int, ...]] = []
    now = 0.0
    for i in range(spec.requests):
        now += rng.expovariate(spec.rate_per_s)
        t = rng.choices(range(spec.tenants), tenant_weights)[0]
        tenant = tenants[t]
        topic = tenant.topics[rng.choices(range(spec.topics_per_tenant), topic_weights)[0]]
        noisy = sorted(range(len(topic)), key=lambda r: r + rng.gauss(0.0, spec.rank_noise))
        picked = [topic[r] for r in noisy[: spec.retrieved]]
        if rng.random() < spec.shuffle_share:
            rng.shuffle(picked)
        content = list(tenant.system)
        for c in picked:
            content.extend(tenant.chunks[c])
        content.extend(fresh(spec.question_blocks))
        # Each tenant's chain starts from its own seed, as the gateway's namespace seed does.
        ids = chain(content, seed=t + 1)
        input_tokens = len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
        output = max(1, round(rng.expovariate(1.0 / spec.output_tokens)))
        requests.append(
            TraceRequest(i, now, input_tokens, output, prefix_key(ids, input_tokens, opts))
        )
        contents.append(tuple(content))
    return RagTrace(tuple(requests), tuple(contents))


@dataclass(frozen=True, slots=True)
class RagShape:
    """How much of a RAG trace's reuse is prefix reuse (what a KV cache can use) and how much is
    content overlap behind a different prefix (what only a similarity hint could see)."""

    requests: int
    # The whole prompt up to the question was seen before (same chunks, same order).
    same_prefix: float
    # The first retrieved chunk (right after the system prompt) was seen before in first place.
    same_first_chunk: float
    # Every retrieved chunk was seen before in some request, but this order was not.
    seen_content_new_order: float


def rag_shape(trace: RagTrace, spec: RagSpec) -> RagShape:
    """Diagnostics of ``trace`` (generated from ``spec``), by request, in trace order."""
    n = len(trace.requests)
    if n == 0:
        return RagShape(0, 0.0, 0.0, 0.0)
    sys_n, chunk_n, q_n = spec.system_blocks, spec.chunk_blocks, spec.question_blocks
    prefixes: set[int] = set()
    firsts: set[int] = set()
    seen_chunks: set[int] = set()
    same_prefix = same_first = new_order = 0
    for req, content in zip(trace.requests, trace.content, strict=True):
        blocks = req.blocks
        body = blocks[: len(blocks) - q_n]
        first = blocks[sys_n + chunk_n - 1] if len(blocks) >= sys_n + chunk_n + q_n else None
        # a chunk's identity: its first content id (chunk ids are unique per tenant)
        chunk_ids = set(content[sys_n : len(content) - q_n : chunk_n])
        prefix_seen = body[-1] in prefixes if body else False
        same_prefix += prefix_seen
        if first is not None:
            same_first += first in firsts
            firsts.add(first)
        new_order += (not prefix_seen) and chunk_ids <= seen_chunks and bool(chunk_ids)
        if body:
            prefixes.add(body[-1])
        seen_chunks |= chunk_ids
    return RagShape(n, same_prefix / n, same_first / n, new_order / n)


def rag_spec(requests: int, seed: int = 0, rate_per_s: float = 20.0,
             options: Sequence[str] = ()) -> RagSpec:
    """A :class:`RagSpec` from CLI values; ``options`` are ``NAME=VALUE`` field overrides."""
    spec = RagSpec(requests=requests, seed=seed, rate_per_s=rate_per_s)
    for item in options:
        name, sep, raw = item.partition("=")
        if not sep or name not in RagSpec.__dataclass_fields__ or name == "requests":
            raise ValueError(f"bad RAG option {item!r}: expected NAME=VALUE, NAME a RagSpec field")
        current = getattr(spec, name)
        spec = dataclasses.replace(spec, **{name: type(current)(raw)})
    return spec
