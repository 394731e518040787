"""vLLM 0.32's KV event wire format, pinned by the real captures (tests/fixtures/vllm-0.32)."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import pytest

from protocol import ProtocolError
from protocol.vllm_events import (
    END_SEQ,
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    UnknownEventType,
    decode_batch,
    decode_events,
    decode_pub_frames,
    decode_replay_frames,
    decode_replay_request,
    encode_batch,
    publisher_binds,
    replay_request,
)
from tests.protocol.vllm_captures import CAPTURES, FIXTURES, fixture_lines, frames, pub_frames, replay_frames


@pytest.mark.parametrize("variant", ["bs16_patched", "bs32"])
def test_captured_payloads_reencode_byte_identical(variant: str) -> None:
    """Our map-form types are vLLM's: decoding a real payload and encoding it gives the same bytes."""
    lines = fixture_lines("zmq_events_raw.jsonl", variant)
    assert lines
    for rec in lines:
        raw = bytes.fromhex(rec["frames_hex"][2])
        batch = decode_batch(raw)
        assert msgspec.msgpack.encode(batch) == raw


@pytest.mark.parametrize("capture", list(CAPTURES))
def test_every_captured_message_decodes_to_the_events_it_carries(capture: str) -> None:
    seqs = []
    for f in pub_frames(capture, extra=capture == "bs16_patched"):
        topic, seq, payload = decode_pub_frames(f)
        assert topic == b"kv-events"
        seqs.append(seq)
        raw_events = msgspec.msgpack.decode(payload)[1]
        events = decode_batch(payload).events
        assert [type(e).__name__ for e in events] == [e["type"] for e in raw_events]
        for ours, raw in zip(events, raw_events, strict=True):
            if not isinstance(ours, AllBlocksCleared):
                assert ours.block_hashes == raw["block_hashes"]
    assert seqs == list(range(len(seqs)))


def test_block_stored_matches_vllm_array_form() -> None:
    stored = BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(32)), block_size=16)
    ts, events, rank = msgspec.msgpack.decode(encode_batch(2.5, [stored], form="array"))
    assert (ts, rank) == (2.5, 0)
    assert events == [["BlockStored", [2**64 - 1, 7], None, list(range(32)), 16, None, "GPU"]]


def test_block_removed_and_cleared_match_vllm_array_form() -> None:
    payload = encode_batch(0.0, [BlockRemoved(block_hashes=[9]), AllBlocksCleared()], form="array")
    assert msgspec.msgpack.decode(payload)[1] == [["BlockRemoved", [9], "GPU"], ["AllBlocksCleared"]]


def test_hashes_above_2_63_are_msgpack_uint64() -> None:
    big = BlockStored(block_hashes=[2**63 + 5], parent_block_hash=2**64 - 2, token_ids=[1] * 16, block_size=16)
    raw = encode_batch(0.0, [big])
    assert b"\xcf" + (2**63 + 5).to_bytes(8, "big") in raw  # uint64, never a negative int64
    assert msgspec.msgpack.decode(raw)[1][0]["block_hashes"] == [2**63 + 5]
    assert decode_batch(raw).events == [big]


def _as_older_array_form(payload: bytes) -> bytes:
    """The captured batch as older vLLM sent it: positional events, bytes hashes, no rank."""
    ts, events, _rank = msgspec.msgpack.decode(payload)

    def h(x: int | None) -> bytes | None:
        return None if x is None else x.to_bytes(8, "big")

    arr: list[list[Any]] = []
    for e in events:
        if e["type"] == "BlockStored":
            arr.append(
                ["BlockStored", [h(x) for x in e["block_hashes"]], h(e["parent_block_hash"]), e["token_ids"],
                 e["block_size"], e["lora_id"], e["medium"]]
            )  # fmt: skip
        elif e["type"] == "BlockRemoved":
            arr.append(["BlockRemoved", [h(x) for x in e["block_hashes"]], e["medium"]])
        else:
            arr.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([ts, arr])


def test_the_older_array_form_with_bytes_hashes_decodes_to_the_same_events() -> None:
    for f in pub_frames("bs32"):
        new, old = decode_batch(f[2]), decode_batch(_as_older_array_form(f[2]))
        assert old.ts == new.ts and old.data_parallel_rank is None
        # The positional form has no extra_keys: everything else is the same event.
        replace = msgspec.structs.replace
        assert [replace(e, extra_keys=None) if isinstance(e, BlockStored) else e for e in new.events] == old.events


def test_unknown_fields_and_event_types_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new_field": 3}, {"type": "Future"}], 0]
    )
    assert decode_batch(payload).events == [BlockRemoved(block_hashes=[1], medium="GPU")]
    only_cleared = decode_batch(msgspec.msgpack.encode({"ts": 2.0, "events": [{"type": "AllBlocksCleared"}]}))
    assert only_cleared.events == [AllBlocksCleared()] and only_cleared.ts == 2.0


def test_an_event_of_an_unknown_type_is_left_out_with_an_error_that_names_its_type() -> None:
    """decode_batch ignores it (above), but decode_events says so: the shim counts and logs it.
    Until 2026-12-07 it was dropped with no word, and a root BlockStored sent as "BlockStoredV2"
    left its children with unknown parents the shim's ERROR blamed on a counter that read 0."""
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStoredV2"}, ["Future", 1, 2], {"type": "AllBlocksCleared"}], 0]
    )
    batch, errors = decode_events(payload)
    assert batch.events == [AllBlocksCleared()]
    assert [(type(e), e.event_type) for e in errors if isinstance(e, UnknownEventType)] == [
        (UnknownEventType, "BlockStoredV2"),
        (UnknownEventType, "Future"),
    ]
    assert len(errors) == 2 and {e.kind for e in errors} == {"unknown event type"}


@pytest.mark.parametrize("kind", [None, 7, b"BlockStored"], ids=["none", "int", "bytes"])
def test_an_event_map_without_a_string_type_is_malformed(kind: object) -> None:
    """It read as type "" and went the unknown type's silent way."""
    event: dict[str, object] = {"block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 16, "block_size": 16}
    if kind is not None:
        event["type"] = kind
    batch, errors = decode_events(msgspec.msgpack.encode([1.0, [event, {"type": "AllBlocksCleared"}], 0]))
    assert batch.events == [AllBlocksCleared()] and len(errors) == 1
    assert not isinstance(errors[0], UnknownEventType) and errors[0].kind == "event map type"
    with pytest.raises(ProtocolError, match="not a string"):
        decode_batch(msgspec.msgpack.encode([1.0, [event]]))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("variant", [*sorted(CAPTURES), "sglang", "sglang-map"])
def test_every_captured_event_is_of_a_known_type(variant: str, engine: str) -> None:
    """vLLM 0.32 sends BlockStored, BlockRemoved and AllBlocksCleared (the captures' README), SGLang
    the same format: none of their events may count as unknown, nor as malformed, whichever
    engine's layout the reader takes, and none reads differently."""
    kinds: set[str] = set()
    sglang = {"sglang": "zmq_events_raw.jsonl", "sglang-map": "zmq_events_map.jsonl"}
    captured = (
        frames(FIXTURES.parent / "sglang" / sglang[variant])
        if variant in sglang
        else pub_frames(variant, extra=variant == "bs16_patched")
    )
    for f in captured:
        batch, errors = decode_events(f[2], engine)
        assert errors == [] and batch == decode_batch(f[2])
        kinds |= {type(e).__name__ for e in batch.events}
    assert kinds >= {"BlockStored", "BlockRemoved"}


_SGLANG_MAMBA = ["BlockStored", [-42], None, [4, 5, 6, 7], 4, None, "GPU", "mamba"]
_MAMBA = BlockStored(
    block_hashes=[-42], parent_block_hash=None, token_ids=[4, 5, 6, 7], block_size=4, component_type="mamba"
)


def test_sglangs_component_type_decodes_from_both_forms() -> None:
    """SGLang's --enable-kv-events-component-types (mem_cache/events.py KVCacheEventRecorder): the
    label is a field of each map, and in the positional form follows medium, before the metadata
    map of a salted request (its BlockStoredWithComponentType(AndMetadata) and
    BlockRemovedWithComponentType). It was ignored in maps, read as lora_name and group_idx in arrays."""
    names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "component_type")
    arrays = [_SGLANG_MAMBA, [*_SGLANG_MAMBA, {"cache_salt": "t"}], ["BlockRemoved", [-42], "GPU", "mamba"]]
    maps = [
        {"type": "BlockStored", **dict(zip(names, _SGLANG_MAMBA[1:], strict=True))},
        {"type": "BlockStored", **dict(zip(names, _SGLANG_MAMBA[1:], strict=True)), "cache_salt": "t"},
        {"type": "BlockRemoved", "block_hashes": [-42], "medium": "GPU", "component_type": "mamba"},
    ]
    expected = [
        _MAMBA,
        msgspec.structs.replace(_MAMBA, cache_salt="t"),
        BlockRemoved(block_hashes=[-42], component_type="mamba"),
    ]
    for events in (arrays, maps):
        assert decode_batch(msgspec.msgpack.encode([1.0, events, 0]), "sglang").events == expected


def test_a_vllm_array_names_lora_name_where_sglang_names_its_component() -> None:
    """vLLM's positional form (before its tagged maps) has lora_name after medium: a LoRA block reads
    as SGLang's component only from an SGLang engine."""
    vllm = decode_batch(msgspec.msgpack.encode([1.0, [_SGLANG_MAMBA]])).events
    assert vllm == [msgspec.structs.replace(_MAMBA, lora_name="mamba", component_type=msgspec.UNSET)]
    assert decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [-42], "GPU", 1]]])).events == [
        BlockRemoved(block_hashes=[-42], group_idx=1)
    ]


_SGLANG_LONG = ["BlockStored", [-42], None, [4, 5, 6, 7], 4, None, "GPU", *[None] * 7]  # to ownership


def test_sglangs_component_type_decodes_after_its_longer_layout() -> None:
    """SGLang's test_kv_events.py (TestBlockStoredWireFormat) pins 13 positional fields of a
    BlockStored (up to locality and ownership, its metadata map at index 14) and 7 of a
    BlockRemoved, new fields only at the end: a label there was ignored, and a Mamba checkpoint read
    as a full root block, its removal as the full block's."""
    removed = ["BlockRemoved", [-42], "GPU", *[None] * 5]

    def read(events: list[object], engine: str) -> list[tuple[object, ...]]:
        batch = decode_batch(msgspec.msgpack.encode([1.0, events, 0]), engine)
        return [
            (type(e).__name__, e.block_hashes, e.component_type, getattr(e, "cache_salt", None))
            for e in batch.events
            if not isinstance(e, AllBlocksCleared)
        ]

    labelled = [[*_SGLANG_LONG, "mamba"], [*_SGLANG_LONG, "mamba", {"cache_salt": "t"}], [*removed, "mamba"]]
    assert read(labelled, "sglang") == [
        ("BlockStored", [-42], "mamba", msgspec.UNSET),
        ("BlockStored", [-42], "mamba", "t"),
        ("BlockRemoved", [-42], "mamba", None),
    ]
    assert read([_SGLANG_LONG, removed], "sglang") == [
        ("BlockStored", [-42], msgspec.UNSET, msgspec.UNSET),
        ("BlockRemoved", [-42], msgspec.UNSET, None),
    ]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(
    "event",
    [
        [*_SGLANG_LONG, None, "mamba"],
        [*_SGLANG_LONG, "mamba", {"cache_salt": "t"}, "x"],
        ["BlockRemoved", [-42], "GPU", *[None] * 5, None, 2],
        ["AllBlocksCleared", None, "x"],
    ],
    ids=["stored", "past-the-map", "removed", "cleared"],
)
def test_a_value_past_the_known_positional_fields_is_malformed(event: list[object], engine: str) -> None:
    """A newer engine's field there is no field this reader knows: the event was read short of it
    (a label past the known slots ignored, its event read as full), where now it is left out, its
    error returned for the shim to count and say, and its batch's other events still read."""
    batch, errors = decode_events(msgspec.msgpack.encode([1.0, [event, ["AllBlocksCleared"]], 0]), engine)
    assert batch.events == [AllBlocksCleared()]
    assert [e.kind for e in errors] == ["unknown positional field"]
    assert not isinstance(errors[0], UnknownEventType) and "known positional fields" in str(errors[0])


def test_a_vllm_array_past_its_known_fields_names_no_component() -> None:
    """Only SGLang's reader takes the field after the longer layout as a component."""
    batch, errors = decode_events(msgspec.msgpack.encode([1.0, [[*_SGLANG_LONG, "mamba"]]]))
    assert batch.events == [] and [e.kind for e in errors] == ["unknown positional field"]
    bad = decode_events(msgspec.msgpack.encode([1.0, [[*_SGLANG_LONG, 2]]]), "sglang")[1]
    assert [e.kind for e in bad] == ["component_type type"]


@pytest.mark.parametrize("form", ["map", "array"])
def test_a_component_type_round_trips_in_both_forms(form: str) -> None:
    events: list[KVEvent] = [_MAMBA, BlockRemoved(block_hashes=[-42], component_type="mamba")]
    assert decode_batch(encode_batch(1.0, events, form=form), "sglang").events == events


def test_a_component_type_that_is_no_string_is_malformed() -> None:
    mamba = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 4,
             "block_size": 4, "lora_id": None, "medium": "GPU", "component_type": 2}  # fmt: skip
    batch, errors = decode_events(msgspec.msgpack.encode([1.0, [mamba, {"type": "AllBlocksCleared"}], 0]))
    assert batch.events == [AllBlocksCleared()] and [e.kind for e in errors] == ["component_type type"]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode(5),
        msgspec.msgpack.encode([1.0, {"type": "AllBlocksCleared"}]),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [0] * 16, 16, "not-an-id"]]]),
    ],
)
def test_malformed_payloads_raise_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed vLLM KV event"):
        decode_batch(payload)


def test_a_batch_nested_too_deeply_is_a_protocol_error() -> None:
    """msgspec's RecursionError escaped decode_events: it ended the shim's event stream (and
    re-registered the worker) where a malformed batch is counted and skipped."""
    with pytest.raises(ProtocolError, match="malformed vLLM KV event: nested too deeply"):
        decode_events(b"\x93\xcb" + b"\0" * 8 + b"\x91" * 3001 + b"\x01\x00")


_MARK = 0x7FFF_ABCD
_STORED = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 16,
           "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}  # fmt: skip


@pytest.mark.parametrize(
    "event",
    [{**_STORED, "medium": _MARK}, {**_STORED, "block_hashes": [_MARK]}, {**_STORED, "metadata": _MARK}],
    ids=["medium", "hash", "metadata"],
)
def test_a_wrong_value_just_under_the_nesting_limit_is_one_malformed_event(event: dict[str, Any]) -> None:
    """The value decodes, and the error naming it must not repr it whole: that repr, a few frames
    deeper than the decode, raised RecursionError (and a huge value flooded the log)."""
    template = msgspec.msgpack.encode([1.0, [event, {"type": "AllBlocksCleared"}], 0])
    limit = sys.getrecursionlimit()
    decoded = 0
    for depth in range(limit - 400, limit + 5):  # past whatever this test's own stack depth is
        payload = template.replace(msgspec.msgpack.encode(_MARK), b"\x91" * depth + b"\x01")
        try:
            batch, errors = decode_events(payload)
        except ProtocolError as exc:
            assert "nested too deeply" in str(exc)
            continue
        decoded += 1
        assert batch.events == [AllBlocksCleared()] and len(errors) == 1
        assert len(str(errors[0])) < 200
    assert decoded > 300


def test_captured_replay_replies_decode_with_and_without_the_topic_frame() -> None:
    replies = replay_frames("bs32", "8")
    seqs = [decode_replay_frames(r)[0] for r in replies]
    assert seqs[0] == 8 and seqs[-1] == END_SEQ and seqs[:-1] == list(range(8, 8 + len(seqs) - 1))
    live = {decode_pub_frames(f)[1]: f[2] for f in pub_frames("bs32")}
    for r in replies[:-1]:
        seq, payload = decode_replay_frames(r)
        assert payload == live[seq]  # replayed payloads are byte-identical
        assert decode_replay_frames([r[0], r[2], r[3]]) == (seq, payload)  # older layout, no topic
    assert [decode_replay_frames(r)[0] for r in replay_frames("bs32", "future")] == [END_SEQ]


def test_replay_request_and_end_marker_match_the_captures() -> None:
    request = fixture_lines("replay_from_8_excerpt.jsonl")[0]["request_frames_hex"]
    assert replay_request(8) == [bytes.fromhex(h) for h in request] == [b"", bytes.fromhex("0000000000000008")]
    assert decode_replay_request(replay_request(8)) == 8
    assert REPLAY_END == replay_frames("bs32", "future")[0] == replay_frames("bs32", "8")[-1]


@pytest.mark.parametrize(
    "frames",
    [[b"kv-events", b"\x00" * 8], [b"kv-events", b"\x00" * 7, b"payload"], [b"t", b"\x00" * 8, b"p", b"extra"]],
)
def test_pub_messages_of_the_wrong_shape_raise_a_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_pub_frames(frames)


@pytest.mark.parametrize("frames", [[b"\x00" * 8], [b"", b"\x00" * 8, b"x"]])
def test_replay_requests_of_the_wrong_shape_raise_a_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_replay_request(frames)


@pytest.mark.parametrize(
    ("seq", "start"), [(b"\x00\x00\x00\x02", 2), (b"\x05", 5), (b"", 0), (b"\x00" * 8 + b"\x00" * 7 + b"\x03", 3)]
)
def test_a_replay_seq_of_any_length_is_read_as_vllm_reads_it(seq: bytes, start: int) -> None:
    """vLLM 0.32 (`ZmqEventPublisher._service_replay`) reads the seq frame with int.from_bytes and
    no length check, and answers; a sim that ignored such a request left its client waiting."""
    assert decode_replay_request([b"", seq]) == start


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router-0:5557", False),
    ],
)
def test_publisher_binds_by_vllms_rule(endpoint: str, binds: bool) -> None:
    assert publisher_binds(endpoint) is binds
