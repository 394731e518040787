"""vLLM's KV events as the adapter-neutral EngineEvents (the wire format: protocol/vllm_events.py).

SGLang publishes the same format; its signed int64 hashes are just other opaque keys. A stored
chain's salt is its LoRA adapter: the name when the engine sends one, else the id as text.
"""

from __future__ import annotations

from protocol.errors import ProtocolError
from protocol.vllm_events import BlockRemoved, BlockStored, KVEvent, decode_batch
from worker_shim.engine_events import EngineCleared, EngineEvent, EngineRemoved, EngineStored, EventDecodeError

__all__ = ["decode_payload", "to_engine_event"]


def to_engine_event(event: KVEvent) -> EngineEvent:
    if isinstance(event, BlockStored):
        salt = event.lora_name or ("" if event.lora_id is None else str(event.lora_id))
        return EngineStored(
            hashes=event.block_hashes,
            parent=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            salt=salt,
            medium=event.medium,
        )
    if isinstance(event, BlockRemoved):
        return EngineRemoved(hashes=event.block_hashes, medium=event.medium)
    return EngineCleared()


def decode_payload(payload: bytes, engine: str = "vllm") -> list[EngineEvent]:
    """One batch payload to engine events; raises EventDecodeError (naming `engine`) if malformed."""
    try:
        batch = decode_batch(payload)
    except ProtocolError as exc:
        raise EventDecodeError(engine, exc.detail) from exc
    return [to_engine_event(e) for e in batch.events]
