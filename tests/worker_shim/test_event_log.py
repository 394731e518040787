"""Sequence numbers, the ring buffer and kvstate replies."""

from __future__ import annotations

import pytest

from protocol import (
    Cleared,
    KvEvent,
    KvStateChunk,
    KvStateRequest,
    Removed,
    Stored,
    decode_msg,
    encode_msg,
    pack_batch,
    pack_chunk,
    unpack_hashes,
)
from worker_shim.event_log import RING_BYTES, RING_SIZE, EventLog, batch_bytes
from worker_shim.kv_publisher import MAX_HASHES

PAYLOAD = 1 << 20  # NATS's default max_payload


def filled(n: int, ring: int = RING_SIZE) -> EventLog:
    log = EventLog("w1", epoch=7, ring_size=ring)
    for i in range(n):
        log.seal([Stored(hashes=[i])])
    return log


def test_seq_starts_at_one_and_increments_by_one() -> None:
    log = filled(3)
    assert [b.seq for b in log.since(0) or []] == [1, 2, 3]


def test_reply_within_the_ring_sends_the_missed_batches_in_order() -> None:
    chunks = list(filled(10).reply(KvStateRequest(since_seq=6, epoch=7), lambda: [999], PAYLOAD))
    assert len(chunks) == 1 and chunks[0].final and not chunks[0].dump
    assert [b.seq for b in chunks[0].batches] == [7, 8, 9, 10] and chunks[0].seq == 10


def test_reply_when_up_to_date_is_one_empty_final_chunk() -> None:
    chunks = list(filled(4).reply(KvStateRequest(since_seq=4, epoch=7), lambda: [], PAYLOAD))
    assert len(chunks) == 1 and chunks[0].final and chunks[0].batches == [] and not chunks[0].dump


def test_a_gap_older_than_the_ring_gets_a_dump_as_of_the_last_seq() -> None:
    log = filled(RING_SIZE + 5)
    chunks = list(log.reply(KvStateRequest(since_seq=2, epoch=7), lambda: [1, 2, 3], PAYLOAD))
    assert [(c.dump, c.seq, c.hashes, c.final) for c in chunks] == [(True, RING_SIZE + 5, [1, 2, 3], True)]
    assert next(log.reply(KvStateRequest(since_seq=5, epoch=7), lambda: [], PAYLOAD)).batches[0].seq == 6


def test_huge_batches_are_held_packed_and_within_the_ring_bytes() -> None:
    """Audit of 2026-12-07: the ring was bounded by a count of batches alone, and held their hashes as
    lists of ints: 4,096 batches of a 100k-token prompt's 6,250 hashes took 1.4 GB, of MAX_HASHES
    4.4 GB. It holds the wire form, at most RING_BYTES of it, however large the batches."""
    log = EventLog("w1", epoch=7)
    hashes = list(range(2**64 - MAX_HASHES, 2**64))  # the same blocks again and again: the digest stays small
    n = RING_BYTES // (8 * MAX_HASHES) + 100
    for _ in range(n):
        log.seal([Stored(hashes=hashes, parent=None, medium="GPU")])
    held = log.since(log.first_seq - 1) or []
    assert sum(len(encode_msg(b)) for b in held) <= RING_BYTES
    stored = [ev for b in held for ev in b.events if isinstance(ev, Stored)]
    assert len(stored) == len(held) and all(
        isinstance(ev.hashes, bytes) and len(ev.hashes) == 8 * MAX_HASHES for ev in stored
    )
    assert sum(len(encode_msg(b)) for b in held) <= log.held_bytes <= RING_BYTES
    assert [b.seq for b in held] == list(range(log.first_seq, n + 1)) and len(held) < n < RING_SIZE
    assert log.since(log.first_seq - 2) is None


def test_a_gap_older_than_the_ring_bytes_gets_a_dump_and_one_within_them_the_batches() -> None:
    size = batch_bytes("w1", [Stored(hashes=[0] * 100)])
    log = EventLog("w1", epoch=7, ring_bytes=3 * size)
    for i in range(10):
        log.seal([Stored(hashes=list(range(i * 100, (i + 1) * 100)))])
    assert log.first_seq == 8 and log.held_bytes == 3 * size
    chunks = list(log.reply(KvStateRequest(since_seq=6, epoch=7), lambda: [1, 2, 3], PAYLOAD))
    assert [(c.dump, c.seq, c.hashes, c.final) for c in chunks] == [(True, 10, [1, 2, 3], True)]
    (replay,) = log.reply(KvStateRequest(since_seq=7, epoch=7), lambda: [], PAYLOAD)
    assert not replay.dump and [b.seq for b in replay.batches] == [8, 9, 10]
    assert [unpack_hashes(ev.hashes) for b in replay.batches for ev in b.events if isinstance(ev, Stored)] == [
        list(range(i * 100, (i + 1) * 100)) for i in (7, 8, 9)
    ]


def test_a_batch_fits_the_ring_as_well_as_the_payload_and_a_larger_one_is_refused() -> None:
    """Review of 6edd5fc: batch_room was max_payload's alone, so with a payload raised past the ring's
    bytes a batch could be sealed that evicted itself at once. The room is the smaller bound's, and
    a seal of more than the ring holds is refused before a seq is spent on it."""
    log = EventLog("w1", epoch=7, ring_bytes=PAYLOAD)
    chunk_framing = 4 * PAYLOAD - EventLog("w1", epoch=7).batch_room(4 * PAYLOAD)
    assert log.batch_room(4 * PAYLOAD) == PAYLOAD - chunk_framing == log.batch_room(PAYLOAD)
    log.seal([Stored(hashes=[1])])
    too_big: list[KvEvent] = [Removed(hashes=list(range(PAYLOAD // 8)))]
    with pytest.raises(ValueError, match=f"exceeds the ring's {PAYLOAD} B"):
        log.seal(too_big)
    assert log.seq == 1 and log.first_seq == 1 and log.digest.blocks == 1


def test_another_epoch_or_none_gets_a_dump() -> None:
    log = filled(3)
    assert next(log.reply(KvStateRequest(since_seq=1, epoch=8), lambda: [5], PAYLOAD)).dump
    assert next(log.reply(KvStateRequest(since_seq=1), lambda: [5], PAYLOAD)).dump


def test_an_empty_dump_is_still_one_final_chunk() -> None:
    (chunk,) = filled(0).reply(KvStateRequest(), lambda: [], PAYLOAD)
    assert chunk.dump and chunk.final and chunk.hashes == [] and chunk.seq == 0 and chunk.chunk == 0


def test_large_dumps_are_chunked_in_order_and_fit_a_nats_payload() -> None:
    hashes = [2**64 - 1 - i for i in range(2 * (PAYLOAD // 8) + 3)]  # a chunk holds a bit under PAYLOAD // 8
    chunks = list(filled(1).reply(KvStateRequest(), lambda: hashes, PAYLOAD))
    assert [c.chunk for c in chunks] == [0, 1, 2] and [c.final for c in chunks] == [False, False, True]
    assert [h for c in chunks for h in c.hashes] == hashes
    for c in chunks:
        raw = encode_msg(c)
        assert len(encode_msg(pack_chunk(c))) <= PAYLOAD and decode_msg(raw, KvStateChunk) == c


def test_large_batch_replies_are_chunked() -> None:
    log = EventLog("w1", 7)
    for i in range(5):
        log.seal([Stored(hashes=list(range(i * 10_000, (i + 1) * 10_000)))])
    chunks = list(log.reply(KvStateRequest(since_seq=0, epoch=7), lambda: [], 200_000))
    assert len(chunks) > 1 and chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert max(len(encode_msg(pack_chunk(c))) for c in chunks) <= 200_000
    assert [b.seq for c in chunks for b in c.batches] == [1, 2, 3, 4, 5]


def test_the_byte_bounds_hold_whatever_the_framing() -> None:
    # The largest values of each field: long names, 64-bit hashes, epochs and seqs, a medium.
    for worker in ("w", "w" * 300):
        log = EventLog(worker, epoch=2**63 - 1)
        log.seq = 2**63 - 2
        chunk_framing = PAYLOAD - log.batch_room(PAYLOAD)
        cases: list[list[KvEvent]] = [
            [Stored(hashes=[2**64 - 1], parent=2**64 - 1, medium="STORAGE" * 40)],
            [Stored(hashes=[2**64 - 1 - i for i in range(1000)], parent=None)] * 3,
            [Removed(hashes=[2**64 - 1], medium="CPU"), Cleared(), Removed(hashes=[])],
        ]
        for events in cases:
            batch = log.seal(events, ts=-1.5e300)
            bound = batch_bytes(worker, events)
            assert len(encode_msg(pack_batch(batch))) <= bound
            (chunk,) = log.reply(KvStateRequest(since_seq=log.seq - 1, epoch=log.epoch), lambda: [], PAYLOAD)
            assert chunk.batches == [batch] and len(encode_msg(pack_chunk(chunk))) <= chunk_framing + bound
        (dump,) = log.reply(KvStateRequest(), lambda: [2**64 - 1] * 100, PAYLOAD)
        assert len(encode_msg(pack_chunk(dump))) <= chunk_framing + 8 * 100
