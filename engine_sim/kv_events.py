"""vLLM's KV-cache events and their two wire forms (ZMQ transport: engine_sim/event_publisher.py).

A batch on the wire is a msgpack array `[ts, events, data_parallel_rank]`. Events are, by default,
msgpack maps tagged by `"type"` with every field present, exactly as vLLM 0.32 sends them
(tests/fixtures/vllm-0.32 holds real captures):

    BlockStored:      type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                      lora_name, extra_keys, group_idx, kv_cache_spec_kind
    BlockRemoved:     type, block_hashes, medium, group_idx
    AllBlocksCleared: type

The older positional form (`--event-form array`, vLLM before the tagged maps) is an array whose first
element is the tag: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.

Block hashes are unsigned 64-bit integers (engine_sim/block_hash.py), opaque to consumers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "ArrayAllBlocksCleared",
    "ArrayBlockRemoved",
    "ArrayBlockStored",
    "ArrayEventBatch",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "decode_batch",
    "encode_batch",
    "to_array_form",
]

MEDIUM_GPU = "GPU"
SPEC_KIND = "full_attention"


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = SPEC_KIND


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True, gc=False):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = 0


class ArrayBlockStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


ArrayKVEvent = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared


class ArrayEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayKVEvent]
    data_parallel_rank: int | None = 0


def to_array_form(event: KVEvent) -> ArrayKVEvent:
    if isinstance(event, BlockStored):
        return ArrayBlockStored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.lora_id, event.medium
        )
    if isinstance(event, BlockRemoved):
        return ArrayBlockRemoved(event.block_hashes, event.medium)
    return ArrayAllBlocksCleared()


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(EventBatch)
_array_decoder = msgspec.msgpack.Decoder(ArrayEventBatch)


def encode_batch(ts: float, events: Sequence[KVEvent], *, form: str = "map", data_parallel_rank: int = 0) -> bytes:
    if form == "array":
        return _encoder.encode(ArrayEventBatch(ts, [to_array_form(e) for e in events], data_parallel_rank))
    return _encoder.encode(EventBatch(ts, list(events), data_parallel_rank))


def decode_batch(payload: bytes, *, form: str = "map") -> EventBatch | ArrayEventBatch:
    """Typed decode of one payload (for tests and tools; the shim has its own edge decoder)."""
    return _array_decoder.decode(payload) if form == "array" else _map_decoder.decode(payload)
