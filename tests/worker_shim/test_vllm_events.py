"""vLLM 0.32's KV event wire format, from the real captures, in both event forms."""

from __future__ import annotations

import msgspec
import pytest

from protocol import Removed, SamplingParams, Stored, block_hashes
from tests.worker_shim.vllm_captures import CAPTURES, FIXTURES, pub_frames, replay_frames
from worker_shim import EngineCleared, EngineRemoved, EngineStored, Normaliser
from worker_shim.adapters.base import LegRequest
from worker_shim.adapters.vllm import completion_body, limits_from_metrics, load_from_metrics
from worker_shim.adapters.vllm_events import (
    END_SEQ,
    decode_payload,
    decode_pub_frames,
    decode_replay_frames,
    replay_request,
)
from worker_shim.engine_events import EventDecodeError


def expected_set(frames: list[list[bytes]], bs: int) -> set[int]:
    """Independent of the normaliser: whole token prefixes per engine hash, references counted."""
    prefix: dict[int, list[int]] = {}
    refs: dict[int, int] = {}
    dec = msgspec.msgpack.Decoder()
    for f in frames:
        for ev in dec.decode(f[2])[1]:
            if ev["type"] == "BlockStored":
                base = prefix[ev["parent_block_hash"]] if ev["parent_block_hash"] is not None else []
                for i, h in enumerate(ev["block_hashes"]):
                    prefix[h] = base + ev["token_ids"][: (i + 1) * bs]
                    refs[h] = refs.get(h, 0) + 1
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    refs[h] -= 1
            else:
                refs.clear()
    return {block_hashes(prefix[h], bs)[-1] for h, r in refs.items() if r > 0}


@pytest.mark.parametrize("capture", list(CAPTURES))
def test_every_captured_vllm_032_frame_decodes_and_normalises(capture: str) -> None:
    bs = CAPTURES[capture]
    frames = pub_frames(capture, extra=capture == "bs16_patched")
    n = Normaliser(bs)
    seqs = []
    for f in frames:
        topic, seq, payload = decode_pub_frames(f)
        assert topic == b"kv-events"
        seqs.append(seq)
        n.apply(decode_payload(payload))
    assert seqs == list(range(len(seqs)))
    assert n.stats.malformed == n.stats.unknown_parent == n.stats.unknown_removed == 0
    assert n.canonical_hashes() == expected_set(frames, bs) != set()


def test_the_captured_duplicate_store_and_remove_of_one_hash_emit_once() -> None:
    frames = pub_frames("bs16_patched", extra=True)
    n = Normaliser(16)
    held: dict[int, int] = {}  # engine references, to find the moments a hash is held twice
    subscriber: set[int] = set()
    doubled = 0
    for f in frames:
        for ev in decode_payload(f[2]):
            for out in n.apply([ev]):
                if isinstance(out, Stored):
                    assert not subscriber & set(out.hashes), "Stored for a hash already held"
                    subscriber.update(out.hashes)
                elif isinstance(out, Removed):
                    assert set(out.hashes) <= subscriber, "Removed for a hash not held"
                    subscriber.difference_update(out.hashes)
                else:
                    subscriber.clear()
            if isinstance(ev, EngineStored):
                for h in ev.hashes:
                    held[h] = held.get(h, 0) + 1
                    doubled += held[h] == 2
            elif isinstance(ev, EngineRemoved):
                for h in ev.hashes:
                    held[h] -= 1
            else:
                held.clear()
    assert doubled >= 1, "the capture stores one hash twice while it is held"
    assert subscriber == n.canonical_hashes() == expected_set(frames, 16)


def _as_array_form(payload: bytes, bytes_hashes: bool) -> bytes:
    ts, events, _rank = msgspec.msgpack.decode(payload)

    def h(x: int | None) -> object:
        return x.to_bytes(8, "big") if bytes_hashes and x is not None else x

    arr = []
    for e in events:
        if e["type"] == "BlockStored":
            arr.append(
                [
                    "BlockStored",
                    [h(x) for x in e["block_hashes"]],
                    h(e["parent_block_hash"]),
                    e["token_ids"],
                    e["block_size"],
                    e["lora_id"],
                    e["medium"],
                ]
            )
        elif e["type"] == "BlockRemoved":
            arr.append(["BlockRemoved", [h(x) for x in e["block_hashes"]], e["medium"]])
        else:
            arr.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([ts, arr])


@pytest.mark.parametrize("bytes_hashes", [False, True])
def test_the_older_array_form_and_bytes_hashes_give_the_same_canonical_set(bytes_hashes: bool) -> None:
    frames = pub_frames("bs32")
    n_map, n_arr = Normaliser(32), Normaliser(32)
    for f in frames:
        n_map.apply(decode_payload(f[2]))
        n_arr.apply(decode_payload(_as_array_form(f[2], bytes_hashes)))
    assert n_arr.canonical_hashes() == n_map.canonical_hashes() != set()


def test_unknown_fields_and_event_types_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new_field": 3}, {"type": "Future"}], 0]
    )
    assert decode_payload(payload) == [EngineRemoved(hashes=[1], medium="GPU")]
    assert decode_payload(msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])) == [EngineCleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode(5),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
    ],
)
def test_malformed_payloads_raise_a_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_payload(payload)


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
    assert replay_request(8) == [b"", bytes.fromhex("0000000000000008")]


def test_limits_and_load_from_captured_metrics() -> None:
    text = (FIXTURES / "bs32" / "metrics_after.txt").read_text()
    lim = limits_from_metrics(text)
    assert (lim.block_size, lim.kv_total_blocks) == (32, 80)
    load = load_from_metrics(text)
    assert (load.running, load.waiting, load.kv_total_blocks, load.kv_usage) == (0, 0, 80, 0.0)


def test_prefill_leg_body_asks_for_remote_decode_and_one_token() -> None:
    leg = LegRequest("r1", "m", [1, 2, 3], SamplingParams(max_tokens=50), prefill_only=True)
    body = completion_body(leg)
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    decode = completion_body(LegRequest("r1", "m", [1], SamplingParams(), transfer={"do_remote_prefill": True}))
    assert decode["kv_transfer_params"] == {"do_remote_prefill": True} and decode["stream"] is True
    assert decode["return_token_ids"] is True
