"""vLLM's KV events as the adapter-neutral EngineEvents (the wire format: protocol/vllm_events.py).

SGLang publishes the same format; its signed int64 hashes are just other opaque keys. A stored
chain's salt (protocol.hashing.chain_salt) is its LoRA adapter (the name when the engine sends
one, else the id as text) and the request's `cache_salt`: the one SGLang names in its metadata
map, else the one vLLM puts in the first block's `extra_keys` after the adapter's name. That is
how the router and the request service salt a prompt of that adapter and cache_salt, so a salted
request's cached prefix is found.

SGLang with `--enable-kv-events-component-types` names each event's KV cache component: each is a
KV cache group here, numbered as its ComponentType numbers it. Its "full" chain (or an event that
names none) is what the index keeps. "swa" names no window size, which vLLM's sliding-window groups
do and the window endpoints need, and "mamba" is one checkpoint per radix node, sent as a root
block holding the node's last page: kinds kvswitch does not model, which the normaliser counts and
drops (their hashes are the full chain's, so a Mamba checkpoint read as full was a bogus root
block, and its removal took the full block away). A label it does not know shares the group after
them, and is dropped the same way.
"""

from __future__ import annotations

from protocol.errors import ProtocolError
from protocol.hashing import chain_salt
from protocol.vllm_events import BlockRemoved, BlockStored, KVEvent, UnknownEventType, decode_events
from worker_shim.engine_events import (
    FULL,
    WINDOW,
    EngineCleared,
    EngineEvent,
    EngineRemoved,
    EngineStored,
    EventDecodeError,
    UnknownEngineEvent,
)

__all__ = ["decode_payload", "decode_ranked", "decode_stamped", "to_engine_event"]


def to_engine_event(event: KVEvent) -> EngineEvent:
    if isinstance(event, BlockStored):
        lora = event.lora_name or ("" if event.lora_id is None else str(event.lora_id))
        salt = chain_salt(lora, _cache_salt(event)) if event.parent_block_hash is None else lora
        window = event.kv_cache_spec_sliding_window
        if isinstance(event.component_type, str):
            group, kind = _component(event.component_type)
        else:
            group, kind = event.group_idx or 0, _kind(event.kv_cache_spec_kind, window)
        return EngineStored(
            hashes=event.block_hashes,
            parent=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            salt=salt,
            medium=event.medium,
            group=group,
            kind=kind,
            window=window if isinstance(window, int) else 0,
        )
    if isinstance(event, BlockRemoved):
        if isinstance(event.component_type, str):
            group, kind = _component(event.component_type)
            return EngineRemoved(hashes=event.block_hashes, medium=event.medium, group=group, kind=kind)
        return EngineRemoved(hashes=event.block_hashes, medium=event.medium, group=event.group_idx or 0)
    return EngineCleared()


# SGLang's ComponentType (mem_cache/unified_cache/component_type.py), in its order.
_COMPONENTS = ("full", "swa", "mamba", "c128", "draft")


def _component(label: str) -> tuple[int, str]:
    """(KV cache group, kind) of an SGLang component; a label outside _COMPONENTS takes the group
    after them, its kind the label."""
    if label == "full":
        return 0, FULL
    return (_COMPONENTS.index(label) if label in _COMPONENTS else len(_COMPONENTS)), label


# vLLM's KVCacheSpecKind values whose blocks hold a prompt's whole prefix, and those that hold a
# sliding window of it (the MLA variant too).
_FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


def _kind(kind: str | None, window: object) -> str:
    if kind is None or kind in _FULL_KINDS:
        return FULL
    if kind in _WINDOW_KINDS and isinstance(window, int) and window > 0:
        return WINDOW
    return kind


def _cache_salt(event: BlockStored) -> str:
    """The request's cache_salt: the one the event names (SGLang), else from a chain's first block
    its extra keys' strings but the adapter's name ("" when it has none)."""
    if isinstance(event.cache_salt, str):
        return event.cache_salt
    first = event.extra_keys[0] if event.extra_keys else None
    if not isinstance(first, list | tuple):
        return ""
    keys = [k for k in first if isinstance(k, str)]
    if event.lora_name in keys:
        keys.remove(event.lora_name)
    return "\x00".join(keys)


def decode_payload(payload: bytes, engine: str = "vllm") -> list[EngineEvent]:
    """One batch payload to engine events; raises EventDecodeError (naming `engine`) if anything in
    it is malformed. Events of a type it does not know are left out."""
    events, _, errors = decode_ranked(payload, engine)
    malformed = [e for e in errors if not isinstance(e, UnknownEngineEvent)]
    if malformed:
        raise malformed[0]
    return events


def decode_ranked(payload: bytes, engine: str = "vllm") -> tuple[list[EngineEvent], int | None, list[EventDecodeError]]:
    """One batch payload to the engine events it holds, the data-parallel rank that published it
    (None: an older engine's batch, which names none), and an EventDecodeError for each event left
    out, malformed or (an UnknownEngineEvent) of a type it does not know: the batch's other events
    still count. Raises EventDecodeError (naming
    `engine`) when the batch as a whole is malformed."""
    events, rank, _, errors = decode_stamped(payload, engine)
    return events, rank, errors


def decode_stamped(
    payload: bytes, engine: str = "vllm"
) -> tuple[list[EngineEvent], int | None, float, list[EventDecodeError]]:
    """As decode_ranked, with the batch's timestamp (the engine's time.time() when it made the
    batch; 0.0 where the batch has none that reads as a number)."""
    try:
        batch, errors = decode_events(payload, engine)
    except ProtocolError as exc:
        raise EventDecodeError(engine, exc.detail, exc.kind) from exc
    events = [to_engine_event(e) for e in batch.events]
    decoded = [
        UnknownEngineEvent(engine, exc.event_type, exc.detail)
        if isinstance(exc, UnknownEventType)
        else EventDecodeError(engine, exc.detail, exc.kind)
        for exc in errors
    ]
    return events, batch.data_parallel_rank, batch.ts, decoded
