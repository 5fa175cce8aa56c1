"""vLLM's KV-cache event wire format: decode (gateway) and encode (reference worker).

A publisher (vLLM's ``ZmqEventPublisher``, or :mod:`worker.kv_events`) sends each batch on a
ZMQ PUB socket as three frames::

    [topic bytes, sequence number as 8-byte big-endian unsigned, msgpack payload]

The payload is a ``KVEventBatch`` struct, ``[ts, [event, ...], data_parallel_rank]`` when
encoded array-like, each event a *tagged* struct whose first element is its class name:

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``;
* ``["BlockRemoved", block_hashes, medium, group_idx]``;
* ``["AllBlocksCleared"]``.

Fields after ``lora_name`` were added in later versions, and msgspec omits trailing fields that
hold their default, so decoding goes by position and tolerates missing or extra trailing
fields. Some versions encode the structs as maps (``{"type": "BlockStored", ...}``); those are
decoded by name. Block hashes are ints (xxhash algorithms) or bytes (sha256 family); both are
kept as given: the gateway keys blocks by its own hash of the token ids, not by these.

The replay protocol (a ROUTER socket beside the PUB): a client sends ``[b"", start_seq]``
(8-byte big-endian) and gets one ``[b"", seq, payload]`` message per buffered batch with
``seq >= start_seq``, then ``[b"", -1 as 8-byte signed big-endian, b""]``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

BlockHash = int | bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class WireError(ValueError):
    """A message that does not follow the KV-event layout."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = MEDIUM_GPU
    # One entry per block (None where a block has none): LoRA name, multimodal ids,
    # cache_salt (first block), ... as the engine mixed them into the block's hash.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


# -- decoding -----------------------------------------------------------------------------------

_DECODER = msgspec.msgpack.Decoder()


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _hash(value: Any) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise WireError(f"block hash must be an int or bytes, got {type(value).__name__}")
    return value


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise WireError("block_hashes must be an array")
    return tuple(_hash(v) for v in value)


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _extra(value: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    if not isinstance(value, list):
        return None
    return tuple(tuple(v) if isinstance(v, list | tuple) else None for v in value)


_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, list[Any]]:
    """(tag, values by position) from an array-like or a map-encoded tagged struct."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        values = list(raw[1 : 1 + len(names)])
        return raw[0], values + [None] * (len(names) - len(values))
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return raw["type"], [raw.get(n) for n in names]
    raise WireError("an event must be a tagged array or map")


def decode_event(raw: Any) -> Event | None:
    """One event; None for an event type this decoder does not know (skipped, not an error)."""
    tag, _ = _fields(raw, ())
    if tag == "BlockStored":
        _, v = _fields(raw, _STORED_FIELDS)
        tokens = v[2]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WireError("token_ids must be an array of ints")
        try:  # msgpack carries unsigned 64-bit ints too: the block keys hash signed ones
            array("q", tokens)
        except OverflowError:
            raise WireError("token_ids must be signed 64-bit ints") from None
        size = v[3]
        if not isinstance(size, int) or size < 1:
            raise WireError("block_size must be a positive int")
        return BlockStored(
            block_hashes=_hashes(v[0]),
            parent_block_hash=None if v[1] is None else _hash(v[1]),
            token_ids=tuple(tokens),
            block_size=size,
            lora_id=v[4] if isinstance(v[4], int) else None,
            medium=_opt_str(v[5]),
            lora_name=_opt_str(v[6]),
            extra_keys=_extra(v[7]),
        )
    if tag == "BlockRemoved":
        _, v = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved(block_hashes=_hashes(v[0]), medium=_opt_str(v[1]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """A ``KVEventBatch`` payload (array-like or map-encoded)."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise WireError("a batch must be [ts, events, data_parallel_rank]")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("a batch must be [ts, events, data_parallel_rank]")
    decoded = tuple(e for e in (decode_event(r) for r in events) if e is not None)
    return EventBatch(float(ts), decoded, rank if isinstance(rank, int) else None)


# -- encoding (array-like, as vLLM's publisher does) ------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()


def _encode_event(event: Event) -> list[Any]:
    if isinstance(event, BlockStored):
        out: list[Any] = [
            "BlockStored", list(event.block_hashes), event.parent_block_hash,
            list(event.token_ids), event.block_size, event.lora_id, event.medium,
            event.lora_name,
        ]
        if event.extra_keys is not None:
            out.append([list(k) if k is not None else None for k in event.extra_keys])
        return out
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(
        [batch.ts, [_encode_event(e) for e in batch.events], batch.data_parallel_rank]
    )


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
