"""Request traces for the cluster simulator: the Mooncake jsonl format and a synthetic generator.

A trace is a sequence of :class:`TraceRequest`, sorted by arrival time. Each request carries its
prompt as a chain of *block ids*, one id per 512-token KV block, in the Mooncake FAST'25 format
(``loadtest/traces/SOURCE.md``)::

    {"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>, "hash_ids": [...]}

Mooncake ids are already prefix-chained (equal ids at the same position of two requests mean a
shared prefix up to there), exactly like the gateway's chained fingerprint hashes, so a request's
:class:`~gateway.fingerprint.PrefixKey` is simply its ids, each mixed through a seeded 64-bit hash
so they look like (and spread like) real block hashes, kept below 2**63 so that the worker's
:class:`~worker.kvcache.PrefixCache` can take them as token ids too. The ring anchor is the block
at ``min(anchor_blocks, len) - 1``, as :func:`gateway.fingerprint.fingerprint` computes it.

Everything is deterministic: the same file (or the same :class:`SyntheticSpec`) gives the same
requests, block hashes and anchors on every machine.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from gateway.fingerprint import FingerprintOptions, PrefixKey

# One Mooncake hash id stands for this many prompt tokens.
BLOCK_TOKENS = 512
# Seed of the id -> block-hash mix (any constant; changing it moves ring placements).
_MIX_SEED = 0x6D6F6F6E63616B65  # "mooncake"
_MASK_63 = (1 << 63) - 1
# The gateway estimates about 4 characters per token (GatewaySettings.chars_per_token).
_CHARS_PER_TOKEN = 4

DEFAULT_TRACE_DIR = Path(__file__).resolve().parent / "traces"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival time, sizes, and its prompt as chained block hashes."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    key: PrefixKey

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.key.blocks

    @property
    def cost_tokens(self) -> int:
        """The load the gateway counts for this request: prompt plus decode budget."""
        return self.input_tokens + self.output_tokens


def mix_block_id(block_id: int) -> int:
    """A deterministic, well-spread 63-bit block hash for a trace block id."""
    return xxhash.xxh3_64_intdigest(block_id.to_bytes(16, "little", signed=True),
                                    seed=_MIX_SEED) & _MASK_63


def prefix_key(block_ids: Sequence[int], input_tokens: int,
               opts: FingerprintOptions | None = None) -> PrefixKey:
    """The routing key of a prompt given as trace block ids (see module docstring)."""
    anchor_blocks = (opts or FingerprintOptions()).anchor_blocks
    blocks = tuple(mix_block_id(b) for b in block_ids)
    anchor = blocks[min(anchor_blocks, len(blocks)) - 1] if blocks else _MIX_SEED
    return PrefixKey(blocks=blocks, anchor=anchor, text_chars=input_tokens * _CHARS_PER_TOKEN)


class TraceFormatError(ValueError):
    """A trace line that is not a Mooncake request object."""


def _int_field(obj: dict[str, object], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def parse_mooncake_line(line: str, index: int, where: str = "",
                        opts: FingerprintOptions | None = None) -> TraceRequest:
    """Parse one jsonl line (``where`` names it in errors)."""
    where = where or f"line {index + 1}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    timestamp = obj.get("timestamp")
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or timestamp < 0:
        raise TraceFormatError(f"{where}: 'timestamp' must be a non-negative number of ms")
    input_tokens = _int_field(obj, "input_length", where)
    output_tokens = _int_field(obj, "output_length", where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in ids
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRequest(
        index=index,
        arrival_s=float(timestamp) / 1000.0,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        key=prefix_key(ids, input_tokens, opts),
    )


def read_mooncake(path: Path | str, limit: int | None = None,
                  opts: FingerprintOptions | None = None) -> list[TraceRequest]:
    """Read a Mooncake jsonl trace (blank lines skipped), at most ``limit`` requests.

    Requests are returned sorted by arrival time (stable: file order among equal timestamps).
    """
    path = Path(path)
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            out.append(parse_mooncake_line(line, len(out), f"{path.name}:{lineno}", opts))
    if any(a.arrival_s > b.arrival_s for a, b in itertools.pairwise(out)):
        out.sort(key=lambda r: r.arrival_s)
        out = [_renumber(r, i) for i, r in enumerate(out)]
    return out


def _renumber(r: TraceRequest, index: int) -> TraceRequest:
    return TraceRequest(index, r.arrival_s, r.input_tokens, r.output_tokens, r.key)


def to_mooncake_lines(requests: Iterable[tuple[float, int, int, Sequence[int]]]) -> Iterator[str]:
    """Mooncake jsonl lines for ``(arrival_s, input_tokens, output_tokens, block_ids)`` tuples."""
    for arrival_s, input_tokens, output_tokens, ids in requests:
        yield json.dumps({
            "timestamp": round(arrival_s * 1000),
            "input_length": input_tokens,
            "output_length": output_tokens,
            "hash_ids": list(ids),
        })


# -- synthetic traces ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """A multi-tenant chat workload in trace form (sizes in 512-token blocks).

    Each tenant has a system prompt of ``system_blocks`` blocks shared by all its requests.
    A request either opens a new conversation (system prompt + ``question_blocks`` fresh blocks)
    or, with probability ``continue_share``, continues one of the tenant's open conversations:
    its previous prompt, an answer block and ``question_blocks`` fresh blocks, so the previous
    prompt is a cacheable prefix. Tenant popularity is Zipf-like (``tenant_skew``); arrivals are
    Poisson at ``rate_per_s``. Conversations stop growing at ``max_blocks``.
    """

    requests: int
    tenants: int = 64
    system_blocks: int = 8
    question_blocks: int = 2
    continue_share: float = 0.6
    open_conversations: int = 8
    max_blocks: int = 128
    tenant_skew: float = 0.8
    output_tokens: int = 256
    rate_per_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 0 or self.tenants < 1 or self.system_blocks < 0:
            raise ValueError("requests >= 0, tenants >= 1 and system_blocks >= 0 are required")
        if self.question_blocks < 1 or self.open_conversations < 1 or self.rate_per_s <= 0:
            raise ValueError("question_blocks, open_conversations and rate_per_s must be > 0")
        if not 0.0 <= self.continue_share <= 1.0:
            raise ValueError("continue_share must be in [0, 1]")


def synthetic_trace(spec: SyntheticSpec,
                    opts: FingerprintOptions | None = None) -> list[TraceRequest]:
    """A deterministic synthetic trace (see :class:`SyntheticSpec`)."""
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(spec.system_blocks) for _ in range(spec.tenants)]
    conversations: list[list[list[int]]] = [[] for _ in range(spec.tenants)]
    weights = [1.0 / (t + 1) ** spec.tenant_skew for t in range(spec.tenants)]
    out: list[TraceRequest] = []
    now = 0.0
    for i in range(spec.requests):
        now += rng.expovariate(spec.rate_per_s)
        tenant = rng.choices(range(spec.tenants), weights)[0]
        convs = conversations[tenant]
        ids: list[int]
        if convs and rng.random() < spec.continue_share:
            slot = rng.randrange(len(convs))
            prev = convs[slot]
            ids = prev + fresh(1 + spec.question_blocks)
            if len(ids) > spec.max_blocks:
                ids = systems[tenant] + fresh(spec.question_blocks)
            convs[slot] = ids
        else:
            ids = systems[tenant] + fresh(spec.question_blocks)
            if len(convs) < spec.open_conversations:
                convs.append(ids)
            else:
                convs[rng.randrange(len(convs))] = ids
        input_tokens = len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
        output = max(1, round(rng.expovariate(1.0 / spec.output_tokens)))
        out.append(TraceRequest(i, now, input_tokens, output, prefix_key(ids, input_tokens, opts)))
    return out
