"""vLLM's KV-cache events on the wire (vllm/distributed/kv_events.py, 0.32), for both ends.

engine_sim encodes with this module and the worker shim decodes with it, so the shapes are
written once. tests/fixtures/vllm-0.32 holds real captures; tests/protocol/test_vllm_events.py
pins them.

Payload: a msgpack batch `[ts, events, data_parallel_rank]` (older vLLM: `[ts, events]`; a map
`{ts, events, ...}` decodes too). Events are msgpack maps tagged by `"type"` with every field
present, as vLLM 0.32 sends them:

    BlockStored:      type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                      lora_name, extra_keys, group_idx, kv_cache_spec_kind
                      (+ kv_cache_spec_sliding_window for a sliding-window group)
    BlockRemoved:     type, block_hashes, medium, group_idx
    AllBlocksCleared: type

or, in the older positional form (vLLM before the tagged maps, and SGLang), arrays led by the tag,
the fields in the maps' order: `["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium(, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window, locality, ownership)]`, `["BlockRemoved", block_hashes, medium(,
group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership)]`,
`["AllBlocksCleared"(, ownership)]` (SGLang's longer layout, its test_kv_events.py
TestBlockStoredWireFormat: new fields only at the end; locality and ownership are not read). A
value past those slots that is not null is no field this reader knows: the event is malformed,
not read short of it. SGLang names a request's
`cache_salt` in a map after the positional fields (its BlockStoredWithMetadata:
`[..., medium, {"cache_salt": "x"}]`, or after the longer layout, whose extra_keys then hold the
salt prefixed for another router), and an event map may carry `cache_salt` by name; vLLM puts it
only in the first block's `extra_keys`.

A hybrid model (sliding-window and full-attention layers: Gemma 2/3, gpt-oss) has one KV cache
group per kind, and each group stores and removes its blocks with events of its own, named by
group_idx; the hashes are the same values in every group. A sliding-window group caches only the
blocks inside its window when they fill, so its BlockStored lists those blocks' hashes while
`token_ids` still covers the whole range from the parent on (`len(token_ids)` is not
`block_size * len(block_hashes)` there).

SGLang with `--enable-kv-events-component-types` (its GitHub main branch, sglang PR #32514; not
in 0.5.23, which has no such flag) names each event's KV cache component,
`component_type` ("full", "swa", "mamba"; mem_cache/events.py KVCacheEventRecorder, which sends
BlockStoredWithComponentType and BlockRemovedWithComponentType): a field of an event map, and in
the positional form, where a field added to BlockStored keyword-only (as BlockStoredWithMetadata
adds its map) goes, right after `medium` and before the metadata map:
`[..., medium, "mamba"(, {"cache_salt": "x"})]`, `["BlockRemoved", block_hashes, medium, "mamba"]`.
vLLM's positional form has `lora_name` and `group_idx` there, so an array is read so only when the
reader says it is SGLang's (`engine="sglang"`) and the array ends there. On the longer layout the
label is the field after `ownership` (index 14 of a BlockStored, before its metadata map; 8 of a
BlockRemoved), read so for SGLang too. "full" is the chain of pages as any engine sends it; a Mamba checkpoint is one
BlockStored per radix node, with no parent, naming the node's last page (its hash and tokens).
vLLM 0.32 sends no such field (a hybrid model's events name their KV cache group, `group_idx`).

SGLang with EAGLE keys its radix cache by bigrams and sends each page's `token_ids` as pairs
`[[t0, t1], [t1, t2], ...]`: pair j starts with the page's own token j, so such a list is read as
those first elements (a BigramTokenIds, which says so downstream).

Block hashes are opaque keys: uint64 from vLLM 0.32, bytes from older vLLM (read big-endian),
signed int64 from SGLang. Decoding ignores unknown fields; an event it cannot read is left out
of its batch (`decode_events` returns its error), a batch it cannot read raises. An event of a
type it does not know is left out too, its UnknownEventType returned among the errors for the
reader to count (`decode_batch` ignores it); a map that names no type is malformed.

ZMQ framing: a PUB message is `[topic, seq as u64 big-endian, payload]`, seq from 0 per engine
start. Replay (DEALER to the engine's ROUTER): request `[b"", start_seq]`; replies `[b"", topic,
seq, payload]` (older vLLM: no topic frame) for every buffered batch from start_seq on, then the
end marker `[b"", b"", END_SEQ, b""]`.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any, Literal, get_args

import msgspec

from protocol.errors import ProtocolError

__all__ = [
    "END_SEQ",
    "EVENT_FORMS",
    "MEDIUM_GPU",
    "REPLAY_END",
    "RESOLVED_BY_ENGINE",
    "AllBlocksCleared",
    "BigramTokenIds",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventForm",
    "KVEvent",
    "UnknownEventType",
    "decode_batch",
    "decode_events",
    "decode_pub_frames",
    "decode_replay_frames",
    "decode_replay_reply",
    "decode_replay_request",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "publisher_binds",
    "rank_endpoint",
    "replay_reply",
    "replay_request",
]

EventForm = Literal["map", "array"]
EVENT_FORMS: tuple[str, ...] = get_args(EventForm)
MEDIUM_GPU = "GPU"
SPEC_KIND = "full_attention"
END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
_WHAT = "vLLM KV event"


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, gc=False):
    """`token_ids` holds every block's tokens back to back; `parent_block_hash` precedes block 0."""

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
    # A sliding-window group's window in tokens; vLLM sends the key only for such groups.
    kv_cache_spec_sliding_window: int | msgspec.UnsetType = msgspec.UNSET
    # The request's cache_salt where the engine names it (SGLang); vLLM's is in extra_keys only.
    cache_salt: str | msgspec.UnsetType = msgspec.UNSET
    # SGLang's KV cache component, where it names one; vLLM names none.
    component_type: str | msgspec.UnsetType = msgspec.UNSET


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True, gc=False):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0
    component_type: str | msgspec.UnsetType = msgspec.UNSET


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = 0


# --- encoding ---------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()


def _array_form(event: KVEvent) -> list[Any]:
    # The older positional form ends at `medium` (lora_name and later fields came with the maps);
    # SGLang's component, then a salted block's metadata map, follow it.
    if isinstance(event, BlockStored):
        e = event
        out = ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium]
        out += _component_field(e)
        return out if e.cache_salt is msgspec.UNSET else [*out, {"cache_salt": e.cache_salt}]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium, *_component_field(event)]
    return ["AllBlocksCleared"]


def _component_field(event: BlockStored | BlockRemoved) -> list[str]:
    return [] if event.component_type is msgspec.UNSET else [event.component_type]


def encode_batch(ts: float, events: Sequence[KVEvent], *, form: str = "map", data_parallel_rank: int = 0) -> bytes:
    """One batch payload; `form` is `map` (vLLM 0.32) or `array` (the older positional form)."""
    if form == "array":
        return _encoder.encode([ts, [_array_form(e) for e in events], data_parallel_rank])
    return _encoder.encode(EventBatch(ts, list(events), data_parallel_rank))


# --- decoding ---------------------------------------------------------------------------------

_decoder = msgspec.msgpack.Decoder()
# Positional field names of the array form, after the tag: vLLM's field order, which SGLang's
# longer layout keeps.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
    ),
    "BlockRemoved": (
        "block_hashes",
        "medium",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
    ),
    "AllBlocksCleared": ("ownership",),
}
# SGLang's component-typed events: its label right after `medium`, where vLLM's has lora_name and
# group_idx, or after the longer layout's last slot; keyed by (type, positional fields after the
# tag, the metadata map left out).
_SGLANG_COMPONENT_FIELDS: dict[tuple[str, int], tuple[str, ...]] = {
    ("BlockStored", 7): (*_ARRAY_FIELDS["BlockStored"][:6], "component_type"),
    ("BlockRemoved", 3): ("block_hashes", "medium", "component_type"),
    ("BlockStored", 14): (*_ARRAY_FIELDS["BlockStored"], "component_type"),
    ("BlockRemoved", 8): (*_ARRAY_FIELDS["BlockRemoved"], "component_type"),
}


def _shown(value: Any) -> str:
    """A peer's value for an error message: reprlib's bounded repr, as a full repr of a value nested
    near the recursion limit raises RecursionError, and of a huge one floods the log."""
    return reprlib.repr(value)


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    raise ProtocolError(_WHAT, f"block hash {_shown(value)} is neither an integer nor bytes", "block hash type")


def _hashes(values: list[Any]) -> list[int]:
    # uint64 as vLLM 0.32 sends them are kept as decoded: a call per hash was 2 ms of a 128 k-token
    # prompt's Stored, all in one turn of the shim's loop
    if all(type(h) is int for h in values):
        return values
    return [_hash(h) for h in values]


def _optional(fields: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = fields.get(name, default)
    if value is None or isinstance(value, kind):
        return value
    raise ProtocolError(_WHAT, f"{name} {_shown(value)} is not a {kind.__name__}", f"{name} type")


class UnknownEventType(ProtocolError):
    """An event of a type this version does not know (a newer engine's?): no malformed event, yet
    one the reader must count and say, as it is dropped."""

    def __init__(self, event_type: str) -> None:
        self.event_type = event_type
        super().__init__(_WHAT, f"unknown event type {_shown(event_type)}", "unknown event type")


def _fields(raw: Any, engine: str) -> tuple[str, dict[str, Any]]:
    """(event type, fields by name) for either event form; `engine` "sglang" reads its positional
    component field."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise ProtocolError(_WHAT, f"an event map's type is {_shown(kind)}, not a string", "event map type")
        return kind, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        values = list(raw[1:])
        # SGLang's metadata map follows the positional fields (msgspec's kw_only field, encoded last).
        metadata = values.pop() if values and isinstance(values[-1], dict) else None
        names = _SGLANG_COMPONENT_FIELDS.get((raw[0], len(values))) if engine == "sglang" else None
        names = names or _ARRAY_FIELDS.get(raw[0], ())
        # A newer engine's field there (a component label past the slots read for it) would be lost,
        # and its event read as another: it is malformed, said, not read short of it.
        if raw[0] in _ARRAY_FIELDS and any(v is not None for v in values[len(names) :]):
            raise ProtocolError(
                _WHAT,
                f"{raw[0]} has {_shown(values[len(names) :])} past its {len(names)} known positional fields",
                "unknown positional field",
            )
        fields = dict(zip(names, values, strict=False))
        return raw[0], fields if metadata is None else {**fields, "metadata": metadata}
    raise ProtocolError(_WHAT, f"an event must be a map or a tagged array, got {type(raw).__name__}", "event type")


class BigramTokenIds(list[int]):
    """Token ids read from SGLang's bigram pages (EAGLE): each pair's first element."""


def _is_pair(p: Any) -> bool:
    return isinstance(p, list) and len(p) == 2 and all(type(t) is int for t in p)


def _token_ids(tokens: list[Any]) -> list[Any]:
    """`token_ids` as sent, or a BigramTokenIds when every entry is an int pair; anything else
    malformed is left for the normaliser to drop."""
    if tokens and all(_is_pair(p) for p in tokens):
        return BigramTokenIds(p[0] for p in tokens)
    return tokens


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes, tokens, bs = f.get("block_hashes"), f.get("token_ids"), f.get("block_size")
    if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(bs, int):
        raise ProtocolError(_WHAT, "BlockStored needs block_hashes, token_ids and block_size")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes(hashes),
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=_token_ids(tokens),
        block_size=bs,
        lora_id=_optional(f, "lora_id", int),
        medium=_optional(f, "medium", str),
        lora_name=_optional(f, "lora_name", str),
        extra_keys=_optional(f, "extra_keys", list),
        group_idx=_optional(f, "group_idx", int, 0),
        kv_cache_spec_kind=_optional(f, "kv_cache_spec_kind", str, SPEC_KIND),
        kv_cache_spec_sliding_window=_optional(f, "kv_cache_spec_sliding_window", int) or msgspec.UNSET,
        cache_salt=_named_salt(f),
        component_type=_component(f),
    )


def _component(f: dict[str, Any]) -> str | msgspec.UnsetType:
    component = _optional(f, "component_type", str)
    return msgspec.UNSET if component is None else component


def _named_salt(f: dict[str, Any]) -> str | msgspec.UnsetType:
    """The cache_salt an event names: in SGLang's metadata map, else as a field of its own."""
    metadata = f.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ProtocolError(_WHAT, f"metadata {_shown(metadata)} is not a map", "metadata type")
    salt = _optional(f if metadata is None else metadata, "cache_salt", str)
    return msgspec.UNSET if salt is None else salt


def _event(raw: Any, engine: str) -> KVEvent:
    kind, f = _fields(raw, engine)
    if kind == "BlockStored":
        return _stored(f)
    if kind == "BlockRemoved":
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise ProtocolError(_WHAT, "BlockRemoved needs block_hashes")
        return BlockRemoved(
            block_hashes=[_hash(h) for h in hashes],
            medium=_optional(f, "medium", str),
            group_idx=_optional(f, "group_idx", int, 0),
            component_type=_component(f),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise UnknownEventType(kind)


def decode_batch(payload: bytes, engine: str = "vllm") -> EventBatch:
    """Any form of batch and event to typed events; raises ProtocolError for anything malformed.
    Events of a type this version does not know are left out, as unknown fields are. `engine`
    "sglang" reads SGLang's positional component field (above); any other, vLLM's layout.

    Hashes come back as ints whatever their wire type; fields an older form lacks take the
    defaults, except `medium`, which stays None when not sent.
    """
    batch, errors = decode_events(payload, engine)
    malformed = [e for e in errors if not isinstance(e, UnknownEventType)]
    if malformed:
        raise malformed[0]
    return batch


def decode_events(payload: bytes, engine: str = "vllm") -> tuple[EventBatch, list[ProtocolError]]:
    """As decode_batch, but an event that cannot be read is left out and its error returned, so it
    does not void the other events of its batch; a batch that cannot be read still raises. An
    event of a type it does not know is left out with an UnknownEventType among the errors."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(_WHAT, f"not msgpack: {exc}", "not msgpack") from exc
    except RecursionError:  # nested past the interpreter's limit: a malformed batch, not a failed reader
        raise ProtocolError(_WHAT, "nested too deeply") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ProtocolError(_WHAT, "a batch must be [ts, events, ...] or a map with events")
    if not isinstance(events, list):
        raise ProtocolError(_WHAT, "the batch's events are not a list")
    decoded: list[KVEvent] = []
    errors: list[ProtocolError] = []
    for item in events:
        try:
            decoded.append(_event(item, engine))
        except ProtocolError as exc:
            errors.append(exc)
    # Odd values of ts or the rank do not void the events: a ts that is no number reads as 0.0,
    # which the shim's endpoint probe takes as no evidence (earlier than any request), and no rank
    # is checked against none.
    batch = EventBatch(
        float(ts) if isinstance(ts, int | float) else 0.0, decoded, rank if isinstance(rank, int) else None
    )
    return batch, errors


# --- ZMQ frames -------------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ProtocolError(_WHAT, f"sequence frame has {len(frame)} bytes, not 8", "sequence frame length")
    return int.from_bytes(frame, "big")


REPLAY_END: list[bytes] = [b"", b"", encode_seq(END_SEQ), b""]


def decode_pub_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """A PUB message to (topic, seq, payload)."""
    if len(frames) != 3:
        raise ProtocolError(_WHAT, f"a PUB message has 3 frames (topic, seq, payload), got {len(frames)}", "PUB frames")
    return bytes(frames[0]), decode_seq(frames[1]), bytes(frames[2])


def replay_request(start_seq: int) -> list[bytes]:
    return [b"", encode_seq(start_seq)]


def decode_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a replay request as the ROUTER sees it, after the peer identity.

    Like vLLM, only the frame count is checked, not the empty delimiter, and the seq frame is read
    big-endian whatever its length (vLLM 0.32 `_service_replay`: an empty one is 0).
    """
    if len(frames) != 2:
        raise ProtocolError(
            _WHAT, f"a replay request has 2 frames (b'', seq), got {len(frames)}", "replay request frames"
        )
    return int.from_bytes(frames[1], "big")


def replay_reply(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [b"", topic, encode_seq(seq), payload]


def decode_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A replay reply to (seq, payload), with or without the topic frame; seq END_SEQ ends the replay."""
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 3:
        parts = parts[1:]
    if len(parts) != 2:
        raise ProtocolError(
            _WHAT, f"a replay reply has [b'', (topic,) seq, payload], got {len(frames)} frames", "replay reply frames"
        )
    return decode_seq(parts[0]), bytes(parts[1])


def decode_replay_reply(frames: Sequence[bytes]) -> tuple[bytes | None, int, bytes]:
    """A replay reply to (topic, seq, payload); topic None when the engine sends no topic frame
    (older vLLM; SGLang 0.5.23 sends one). The replay socket reveals the topic a subscriber filtering by another
    one never sees."""
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]
    topic = bytes(parts[0]) if len(parts) == 3 else None
    seq, payload = decode_replay_frames(frames)
    return topic, seq, payload


# vLLM lists this endpoint on GET /kv_event_sources as the `tcp://<node IP>:<port>` its PUB bound
# (vllm/distributed/kv_events.py ZmqEventPublisher._bind); every other one as it was given.
RESOLVED_BY_ENGINE = "tcp://*:0"


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB binds for `*`, `::`, ipc:// and inproc:// endpoints and connects otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank `rank` of a vLLM given `endpoint` publishes (or serves replay): the
    TCP port plus the rank, `_dp{rank}` after an inproc name; rank 0 and port 0 as given
    (vllm.distributed.kv_events offset_endpoint_port)."""
    if not rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}" if port.isdigit() and int(port) else endpoint
