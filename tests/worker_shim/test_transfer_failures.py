"""TransferFailures: the engine's failed-pull counter, read with the load polls, less the pulls
whose legs failed (the router saw those)."""

from __future__ import annotations

import logging

import pytest

from worker_shim.transfer_failures import TransferFailures


def test_a_rise_no_failed_leg_explains_by_the_next_reading_is_silent() -> None:
    t = TransferFailures("e")
    assert not t.reading(3, 0.0)  # the first reading is the baseline
    assert not t.reading(5, 0.25)  # two failures seen: judged at the next reading
    assert t.reading(5, 0.5) and t.total == 2
    assert not t.reading(0, 0.75)  # the engine restarted: a new baseline
    assert not t.reading(1, 1.0)
    assert t.reading(1, 1.25) and t.total == 3
    assert not t.reading(None, 1.5)  # no counter: nothing, and the next reading is a baseline
    assert not t.reading(9, 1.75) and not t.reading(9, 2.0) and t.total == 3


def test_pulls_whose_legs_failed_are_not_silent_whichever_comes_first() -> None:
    t = TransferFailures("e")
    t.reading(0, 0.0)
    assert not t.reading(1, 0.25)  # the engine counted it; the leg's 500 is still on its way
    t.leg_failed()
    assert not t.reading(1, 0.5) and t.total == 0
    t.leg_failed()  # the leg's 500 came before the reading that holds its count
    assert not t.reading(2, 0.75) and not t.reading(2, 1.0) and t.total == 0
    assert not t.reading(3, 1.25) and t.reading(3, 1.5) and t.total == 1  # a third, silent


def test_a_warning_when_silent_failures_start_after_a_quiet_minute(caplog: pytest.LogCaptureFixture) -> None:
    t = TransferFailures("http://engine", quiet_s=60.0)
    with caplog.at_level(logging.WARNING, logger="worker_shim.transfer_failures"):
        for at, count in ((0.0, 0), (1.0, 1), (2.0, 1), (30.0, 4), (31.0, 4), (89.0, 5), (90.0, 5), (150.0, 6)):
            t.reading(count, at)
        t.reading(6, 151.0)  # 61 s after the last: a new episode
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "http://engine failed 1 KV pull(s) without failing the request" in warned[0]
    assert t.total == 6
