"""protocol.packed: block hashes as little-endian u64s, the form shims send them in."""

from __future__ import annotations

import struct

import pytest

from protocol import (
    Cleared,
    KvEventBatch,
    KvStateChunk,
    Removed,
    Stored,
    check_hashes,
    decode_msg,
    encode_msg,
    hash_count,
    pack_batch,
    pack_chunk,
    pack_hashes,
    unpack_hashes,
)

EDGES = [0, 1, 255, 256, 2**32, 2**63, 2**64 - 1]


def test_the_packing_is_little_endian_u64s_and_round_trips() -> None:
    packed = pack_hashes(EDGES)
    assert packed == struct.pack(f"<{len(EDGES)}Q", *EDGES)
    assert unpack_hashes(packed) == EDGES == unpack_hashes(EDGES)
    assert hash_count(packed) == hash_count(EDGES) == len(EDGES)
    assert pack_hashes(packed) is packed
    assert pack_hashes([]) == b"" and unpack_hashes(b"") == []


@pytest.mark.parametrize("bad", [-1, 2**64, "7", 1.5])
def test_a_hash_that_is_not_a_u64_cannot_be_packed(bad: object) -> None:
    with pytest.raises(ValueError, match=repr(bad)):
        pack_hashes([1, bad])  # type: ignore[list-item]


def test_check_refuses_partial_u64s_and_out_of_range_ints() -> None:
    check_hashes(pack_hashes(EDGES))
    check_hashes(EDGES)
    check_hashes([])
    with pytest.raises(ValueError, match="multiple of 8 bytes, got 9"):
        check_hashes(b"\x00" * 9)
    with pytest.raises(ValueError, match="multiple of 8 bytes, got 9"):
        unpack_hashes(b"\x00" * 9)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        check_hashes([3, -1])


def test_a_packed_batch_decodes_to_the_same_events_with_bytes_for_lists() -> None:
    batch = KvEventBatch(
        worker="w",
        epoch=3,
        seq=9,
        ts=1.5,
        events=[Stored(hashes=EDGES, parent=7, medium="GPU"), Removed(hashes=[1]), Cleared()],
    )
    got = decode_msg(encode_msg(pack_batch(batch)), KvEventBatch)
    stored, removed, cleared = got.events
    assert isinstance(stored, Stored) and isinstance(removed, Removed) and isinstance(cleared, Cleared)
    assert isinstance(stored.hashes, bytes) and unpack_hashes(stored.hashes) == EDGES
    assert (stored.parent, stored.medium) == (7, "GPU")
    assert unpack_hashes(removed.hashes) == [1]
    assert (got.worker, got.epoch, got.seq, got.ts) == ("w", 3, 9, 1.5)
    assert batch.events[0] == Stored(hashes=EDGES, parent=7, medium="GPU")  # the original is left as it was
    # 64-bit hashes take 9 bytes each as msgpack ints and 8 packed.
    wide = KvEventBatch(worker="w", epoch=1, seq=1, ts=0.0, events=[Stored(hashes=[2**63 + i for i in range(100)])])
    assert len(encode_msg(pack_batch(wide))) < len(encode_msg(wide))


def test_a_packed_chunk_packs_its_dump_and_its_batches() -> None:
    inner = KvEventBatch(worker="w", epoch=1, seq=2, ts=0.0, events=[Stored(hashes=[4, 5])])
    chunk = KvStateChunk(worker="w", epoch=1, seq=2, batches=[inner], dump=True, hashes=[1, 2, 3])
    got = decode_msg(encode_msg(pack_chunk(chunk)), KvStateChunk)
    assert got.hashes == pack_hashes([1, 2, 3])
    assert got.batches[0].events[0] == Stored(hashes=pack_hashes([4, 5]))
    # Lists still decode: shims that predate packing keep working.
    assert decode_msg(encode_msg(chunk), KvStateChunk).hashes == [1, 2, 3]
