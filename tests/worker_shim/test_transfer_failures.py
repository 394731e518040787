"""TransferFailures: the engine's failed-pull counter, read with the load polls."""

from __future__ import annotations

import logging

import pytest

from worker_shim.transfer_failures import TransferFailures


def test_rises_are_counted_a_restart_starts_over_and_none_counts_nothing() -> None:
    t = TransferFailures("e")
    assert not t.reading(3, 0.0)  # the first reading is the baseline
    assert not t.reading(3, 0.25)
    assert t.reading(5, 0.5) and t.total == 2
    assert not t.reading(0, 0.75)  # the engine restarted
    assert t.reading(1, 1.0) and t.total == 3
    assert not t.reading(None, 1.25)  # no counter: nothing, and the next reading is a baseline
    assert not t.reading(9, 1.5) and t.total == 3


def test_a_warning_when_failures_start_after_a_quiet_minute(caplog: pytest.LogCaptureFixture) -> None:
    t = TransferFailures("http://engine", quiet_s=60.0)
    with caplog.at_level(logging.WARNING, logger="worker_shim.transfer_failures"):
        t.reading(0, 0.0)
        t.reading(1, 1.0)
        t.reading(4, 30.0)  # the same episode: no second warning
        t.reading(5, 89.0)  # 59 s after the last failure: still the same
        t.reading(6, 150.0)  # 61 s later: a new one
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "http://engine failed 1 KV pull(s)" in warned[0] and "recompute" in warned[0]
