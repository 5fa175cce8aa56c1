"""vLLM's KV-event wire format: decoded field by field, and what the worker publishes."""

from __future__ import annotations

import msgspec
import pytest

from gateway.contracts.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)


def vllm_payload() -> bytes:
    """A batch laid out as vLLM's msgspec structs encode it array-like: [ts, events, dp_rank],
    each event a tagged array with the class name first, in field-declaration order."""
    stored = [
        "BlockStored",
        [b"\x01" * 32, b"\x02" * 32],  # block_hashes (sha256: bytes)
        None,  # parent_block_hash
        list(range(32)),  # token_ids: two blocks of 16
        16,  # block_size
        None,  # lora_id (deprecated)
        "GPU",  # medium
        None,  # lora_name
        [["tenant-salt"], None],  # extra_keys, one entry per block
        0,  # group_idx (newer versions)
        "full_attention",  # kv_cache_spec_kind
        None,  # kv_cache_spec_sliding_window
        "a field from the future",
    ]
    removed = ["BlockRemoved", [b"\x01" * 32], "GPU", 0]
    return msgspec.msgpack.encode([1712345678.5, [stored, removed, ["AllBlocksCleared"]], 0])


def test_vllm_batch_decodes_field_by_field() -> None:
    batch = decode_batch(vllm_payload())
    assert batch.ts == 1712345678.5
    assert batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (b"\x01" * 32, b"\x02" * 32)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(32))
    assert stored.block_size == 16
    assert stored.medium == "GPU"
    assert stored.lora_name is None
    assert stored.extra_keys == (("tenant-salt",), None)
    assert removed == BlockRemoved(block_hashes=(b"\x01" * 32,), medium="GPU")
    assert cleared == AllBlocksCleared()


def test_older_layout_without_trailing_fields_and_int_hashes() -> None:
    # vLLM before extra_keys, with xxhash block hashes (ints) and no data_parallel_rank.
    stored = ["BlockStored", [11, 12], 10, list(range(32)), 16, None, "GPU", None]
    batch = decode_batch(msgspec.msgpack.encode([1.0, [stored]]))
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (11, 12)
    assert event.parent_block_hash == 10
    assert event.extra_keys is None
    assert batch.data_parallel_rank is None


def test_map_encoded_structs_decode_by_name() -> None:
    stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2, "medium": "GPU", "lora_name": "ad"}
    batch = decode_batch(msgspec.msgpack.encode({"ts": 2.0, "events": [stored]}))
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert (event.block_hashes, event.token_ids, event.lora_name) == ((5,), (1, 2), "ad")


def test_unknown_event_types_are_skipped() -> None:
    batch = decode_batch(msgspec.msgpack.encode([1.0, [["SomethingNew", 1], ["AllBlocksCleared"]]]))
    assert batch.events == (AllBlocksCleared(),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"no": "batch"}),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, "not tokens", 16]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1], 16]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]),
        # A token id past a signed 64-bit int (msgpack's uint64): the block keys cannot hash it.
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [2**63] + [1] * 15, 16]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1] * 15 + [2**64 - 1], 16]]]),
        msgspec.msgpack.encode([1.0, [[1, 2]]]),
    ],
)
def test_malformed_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_our_encoding_is_vllm_layout() -> None:
    batch = EventBatch(3.0, (
        BlockStored(block_hashes=(7, 8), parent_block_hash=6, token_ids=(1, 2, 3, 4),
                    block_size=2, extra_keys=(("ns",), None)),
        BlockRemoved(block_hashes=(7,)),
        AllBlocksCleared(),
    ), 0)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        3.0,
        [
            ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", None, [["ns"], None]],
            ["BlockRemoved", [7], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert decode_batch(encode_batch(batch)) == batch


def test_sequence_frames() -> None:
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(258)) == 258
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(WireError):
        decode_seq(b"\x00")
