"""vLLM's KV event wire format (vllm/distributed/kv_events.py), decoded by hand so both forms pass.

A PUB message is three frames: topic, seq (8 bytes big-endian), msgpack payload. The payload is a
batch `[ts, events, data_parallel_rank]` (older: `[ts, events]`; a map form `{ts, events, ...}` is
accepted too). Each event is a map tagged by `type` (vLLM 0.26+: `{"type": "BlockStored", ...}`) or
the older positional array `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name]`. Hashes are uint64 ints or bytes (older vLLM); unknown fields and event
types are ignored. SGLang publishes the same format (its signed int64 hashes are just other keys).

Replay (DEALER -> the engine's ROUTER): request `[b"", seq]`; replies `[b"", topic, seq, payload]`
(vLLM 0.32) or `[b"", seq, payload]` (older), ending with seq 0xFFFFFFFFFFFFFFFF and an empty payload.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec

from worker_shim.engine_events import (
    EngineCleared,
    EngineEvent,
    EngineRemoved,
    EngineStored,
    EventDecodeError,
)

__all__ = ["END_SEQ", "decode_payload", "decode_pub_frames", "decode_replay_frames", "replay_request"]

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
_SEQ = struct.Struct(">Q")
_decoder = msgspec.msgpack.Decoder()
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hash(value: Any, engine: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    raise EventDecodeError(engine, f"block hash {value!r} is neither an integer nor bytes")


def _fields(raw: Any, names: Sequence[str], engine: str) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        kind = raw.get("type")
        return (kind if isinstance(kind, str) else ""), raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    raise EventDecodeError(engine, f"an event must be a map or a tagged array, got {type(raw).__name__}")


def _event(raw: Any, engine: str) -> EngineEvent | None:
    kind, f = _fields(raw, _STORED_FIELDS, engine)
    if kind == "BlockStored":
        hashes, tokens, bs = f.get("block_hashes"), f.get("token_ids"), f.get("block_size")
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(bs, int):
            raise EventDecodeError(engine, "BlockStored needs block_hashes, token_ids and block_size")
        parent = f.get("parent_block_hash")
        lora_name, lora_id = f.get("lora_name"), f.get("lora_id")
        salt = str(lora_name) if lora_name else ("" if lora_id is None else str(lora_id))
        medium = f.get("medium")
        return EngineStored(
            hashes=[_hash(h, engine) for h in hashes],
            parent=None if parent is None else _hash(parent, engine),
            token_ids=tokens,
            block_size=bs,
            salt=salt,
            medium=medium if isinstance(medium, str) else None,
        )
    if kind == "BlockRemoved":
        if not isinstance(raw, dict):
            f = dict(zip(_REMOVED_FIELDS, raw[1:], strict=False))
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise EventDecodeError(engine, "BlockRemoved needs block_hashes")
        medium = f.get("medium")
        return EngineRemoved(
            hashes=[_hash(h, engine) for h in hashes], medium=medium if isinstance(medium, str) else None
        )
    if kind == "AllBlocksCleared":
        return EngineCleared()
    return None  # an event type this shim does not know: ignored, like unknown fields


def decode_payload(payload: bytes, engine: str = "vllm") -> list[EngineEvent]:
    """One batch payload to engine events; raises EventDecodeError for anything malformed."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(engine, f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        events = raw.get("events")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        events = raw[1]
    else:
        raise EventDecodeError(engine, "a batch must be [ts, events, ...] or a map with events")
    if not isinstance(events, list):
        raise EventDecodeError(engine, "the batch's events are not a list")
    out: list[EngineEvent] = []
    for e in events:
        ev = _event(e, engine)
        if ev is not None:
            out.append(ev)
    return out


def decode_seq(frame: bytes, engine: str = "vllm") -> int:
    if len(frame) != 8:
        raise EventDecodeError(engine, f"sequence frame has {len(frame)} bytes, not 8")
    return int(_SEQ.unpack(frame)[0])


def decode_pub_frames(frames: Sequence[bytes], engine: str = "vllm") -> tuple[bytes, int, bytes]:
    """A PUB message to (topic, seq, payload)."""
    if len(frames) != 3:
        raise EventDecodeError(engine, f"a PUB message has 3 frames (topic, seq, payload), got {len(frames)}")
    return bytes(frames[0]), decode_seq(frames[1], engine), bytes(frames[2])


def decode_replay_frames(frames: Sequence[bytes], engine: str = "vllm") -> tuple[int, bytes]:
    """A replay reply to (seq, payload), with or without the topic frame; seq END_SEQ ends the replay."""
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 3:
        parts = parts[1:]
    if len(parts) != 2:
        raise EventDecodeError(engine, f"a replay reply has [b'', (topic,) seq, payload], got {len(frames)} frames")
    return decode_seq(parts[0], engine), bytes(parts[1])


def replay_request(start_seq: int) -> list[bytes]:
    return [b"", _SEQ.pack(start_seq)]
