"""Pending prefixes: what a worker is about to cache, matched with the index, ended by events,
removal or expiry."""

from __future__ import annotations

from router.pending_prefixes import PendingPrefixes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_leading_blocks_match_per_worker() -> None:
    p = PendingPrefixes(10.0, Clock())
    p.add("w1", [1, 2, 3, 4])
    p.add("w2", [1, 2, 9])
    assert p.match([1, 2, 3, 5]) == {"w1": 3, "w2": 2}
    assert p.match([7, 2, 3]) == {}  # its first block is pending nowhere
    assert p.match([1, 2, 3], workers=["w2"]) == {"w2": 2}


def test_entries_expire_after_the_ttl_and_are_pruned() -> None:
    clock = Clock()
    p = PendingPrefixes(10.0, clock)
    p.add("w1", [1, 2])
    clock.now += 5
    p.add("w2", [1, 2])
    clock.now += 5  # w1's entry is exactly at its expiry: gone
    assert p.match([1, 2]) == {"w2": 2}
    p.prune()
    assert len(p) == 2
    clock.now += 5
    p.prune()
    assert len(p) == 0 and p.match([1, 2]) == {}


def test_a_renewed_booking_outlives_the_first_one() -> None:
    clock = Clock()
    p = PendingPrefixes(10.0, clock)
    p.add("w1", [1, 2])
    clock.now += 8
    p.add("w1", [1, 2])  # the same prefix routed there again
    clock.now += 4  # the first booking's time is up, the second's is not
    p.prune()
    assert p.match([1, 2]) == {"w1": 2}


def test_events_confirm_and_a_leaving_worker_forgets_its_entries() -> None:
    p = PendingPrefixes(10.0, Clock())
    p.add("w1", [1, 2, 3])
    p.add("w2", [1, 2, 3])
    p.confirm("w1", [1, 2])  # stored: the index speaks for these now
    assert p.match([1, 2, 3]) == {"w2": 3}
    p.forget_worker("w2")
    assert p.match([1, 2, 3]) == {} and len(p) == 1  # w1's block 3 is still pending


def test_ttl_zero_turns_it_off() -> None:
    p = PendingPrefixes(0.0, Clock())
    p.add("w1", [1, 2])
    assert p.match([1, 2]) == {} and len(p) == 0
