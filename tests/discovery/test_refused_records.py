"""RefusedRecords: a refused record is said once per key while its reason stands, and at most once
a window while its reason keeps changing, with how many times it changed (logonce audit of
2026-12-07, findings 2 and 5: a line per put)."""

from __future__ import annotations

import asyncio

from discovery.refused_records import RefusedRecords

LINE = "record under key %r ignored: %s"


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _records(window_s: float = 10.0) -> tuple[RefusedRecords, list[str], _Clock]:
    said: list[str] = []
    clock = _Clock()
    records = RefusedRecords(lambda name, msg, *args: said.append(msg % args), LINE, window_s=window_s, clock=clock)
    return records, said, clock


def test_the_same_reason_again_is_not_said_again() -> None:
    records, said, _ = _records()
    for _ in range(1000):
        records.refused("badr", "not json")
    assert said == ["record under key 'badr' ignored: not json"]


def test_a_reason_that_keeps_changing_is_one_line_a_window_with_its_changes_counted() -> None:
    records, said, clock = _records()
    reasons = ["not json", "missing field", "newer schema", "not an object"]
    for i in range(1000):  # within one window
        records.refused("bad1", reasons[i % 4])
    assert said == ["record under key 'bad1' ignored: not json"]
    clock.now = 10.0
    records.refused("bad1", "not json")  # the window is over: the reason now, and the changes since
    assert said[1:] == [
        "record under key 'bad1' ignored: not json (changes of its reason since it was last said: 1000)"
    ]
    clock.now = 11.0
    records.refused("bad1", "missing field")
    records.flush()  # as its owner stops
    assert said[2:] == [
        "record under key 'bad1' ignored: missing field (changes of its reason since it was last said: 1)"
    ]
    records.flush()
    assert len(said) == 3


def test_each_key_is_said_and_a_key_taken_again_is_said_anew() -> None:
    records, said, _ = _records()
    for i in range(3):
        records.refused(f"k{i}", "not json")
    records.accepted("k0")  # a good record put, or the key deleted
    records.refused("k0", "not json")
    records.refused("k1", "not json")
    assert said == [f"record under key {k!r} ignored: not json" for k in ("k0", "k1", "k2", "k0")]
    assert sorted(records.names()) == ["k0", "k1", "k2"]


async def test_a_change_held_is_said_when_its_window_ends() -> None:
    records, said, clock = _records(window_s=0.05)
    records.refused("bad1", "a")
    records.refused("bad1", "b")
    records.refused("bad1", "c")
    assert len(said) == 1
    clock.now = 0.05
    await asyncio.sleep(0.1)  # the loop's timer, with no further refusal
    assert said[1:] == ["record under key 'bad1' ignored: c (changes of its reason since it was last said: 2)"]


async def test_a_key_taken_again_before_its_window_ends_says_nothing_more() -> None:
    records, said, _ = _records(window_s=0.05)
    records.refused("bad1", "a")
    records.refused("bad1", "b")
    records.accepted("bad1")
    await asyncio.sleep(0.1)
    assert said == ["record under key 'bad1' ignored: a"]
