"""LoopWatch: how long this process's loop has been awake, a stall of its own seen at once."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from runtime import loop_watch
from runtime.loop_watch import TICK_S, LoopWatch


async def test_a_stall_reads_as_no_time_awake_then_counts_from_its_end() -> None:
    watch = LoopWatch()
    assert watch.awake_for() == math.inf  # not started: nothing to say
    watch.start()
    try:
        await asyncio.sleep(0.3)
        assert watch.awake_for() >= 0.25 and watch.stalls == 0
        time.sleep(0.5)  # a GC pause, a long synchronous step
        assert watch.awake_for() == 0.0, "a stall not yet seen by the watch"
        await asyncio.sleep(3 * TICK_S)
        awake = watch.awake_for()
        assert 0.0 < awake <= 4 * TICK_S and watch.stalls == 1
    finally:
        await watch.stop()


async def test_the_time_stalled_within_a_span_counts_stalls_seen_and_unseen_and_forgets_old_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop_watch, "STALLS_KEPT_S", 1.0)
    watch = LoopWatch()
    assert watch.stalled_within(10.0) == 0.0  # not started: nothing to credit
    watch.start()
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(0.2)
        assert watch.stalled_within(10.0) == 0.0
        time.sleep(0.4)
        unseen = watch.stalled_within(10.0)
        assert 0.4 <= unseen <= 0.4 + 2 * TICK_S, "a stall not yet seen by the watch"
        assert watch.stalled_within(0.1) == pytest.approx(0.1)  # only what lies within the span
        at = loop.time()
        await asyncio.sleep(0.3)
        assert watch.stalls == 1
        seen = watch.stalled_within(10.0)
        assert unseen <= seen <= 0.4 + 3 * TICK_S  # its span: from the last tick on time to the late one
        assert watch.stalled_within(0.15) == 0.0  # awake since
        assert watch.stalled_within(0.1, until=at) == pytest.approx(0.1)  # as it stood at `at`
        await asyncio.sleep(1.0)
        time.sleep(0.3)
        await asyncio.sleep(3 * TICK_S)
        # the first stall ended over STALLS_KEPT_S before the second: forgotten, the memory bounded
        assert watch.stalls == 2 and 0.3 <= watch.stalled_within(10.0) <= 0.3 + 3 * TICK_S
    finally:
        await watch.stop()
