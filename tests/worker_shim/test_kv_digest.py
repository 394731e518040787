"""The KV digest sealed with each batch equals an independent recomputation from the batches."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import Cleared, KvEvent, KvEventBatch, Removed, Stored, pack_events, unpack_hashes
from worker_shim.event_log import EventLog
from worker_shim.kv_digest import KvDigest

_hashes = st.lists(st.integers(min_value=0, max_value=2**64 - 1) | st.integers(min_value=0, max_value=40), max_size=6)
_event = st.one_of(
    _hashes.map(lambda hs: Stored(hashes=hs)),
    _hashes.map(lambda hs: Removed(hashes=hs)),
    st.just(Cleared()),
)


def replayed(batches: list[KvEventBatch]) -> set[int]:
    """What a subscriber holds after applying the batches in order: the router's rules."""
    held: set[int] = set()
    for b in batches:
        for e in b.events:
            if isinstance(e, Stored):
                held.update(unpack_hashes(e.hashes))
            elif isinstance(e, Removed):
                held.difference_update(unpack_hashes(e.hashes))
            else:
                held.clear()
    return held


def xor_of(hashes: set[int]) -> int:
    out = 0
    for h in hashes:
        out ^= h
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_event, min_size=1, max_size=5), min_size=1, max_size=25))
def test_digest_at_every_seq_equals_the_set_rebuilt_from_batches_one_to_seq(batches: list[list[KvEvent]]) -> None:
    log = EventLog("w1", epoch=3)
    sealed: list[KvEventBatch] = []
    for events in batches:
        sealed.append(log.seal(events))
        expected = replayed(sealed)
        assert (log.digest.blocks, log.digest.xor) == (len(expected), xor_of(expected)), f"at seq {log.seq}"


def test_duplicates_and_removals_of_absent_hashes_follow_set_rules() -> None:
    d = KvDigest()
    d.apply([Stored(hashes=[5, 5, 9]), Removed(hashes=[7]), Stored(hashes=[9])])
    assert (d.blocks, d.xor) == (2, 5 ^ 9)
    d.apply([Removed(hashes=[5, 5])])
    assert (d.blocks, d.xor) == (1, 9)
    d.apply([Cleared(), Stored(hashes=[2**64 - 1])])
    assert (d.blocks, d.xor) == (1, 2**64 - 1)


def test_packed_hashes_give_the_digest_of_the_same_hashes_as_ints() -> None:
    """Review of 6edd5fc: iterating packed bytes yields ints of one byte each, a wrong digest that
    routers would repair over and over; the ring's batches are packed, so apply unpacks them."""
    events: list[KvEvent] = [Stored(hashes=[5, 2**64 - 1, 9]), Removed(hashes=[9, 7]), Stored(hashes=[2**40])]
    as_ints, packed = KvDigest(), KvDigest()
    as_ints.apply(events)
    packed.apply(pack_events(events))
    assert (packed.blocks, packed.xor) == (as_ints.blocks, as_ints.xor) == (3, 5 ^ (2**64 - 1) ^ 2**40)
