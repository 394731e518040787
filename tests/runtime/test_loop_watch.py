"""LoopWatch: how long this process's loop has been awake, a stall of its own seen at once."""

from __future__ import annotations

import asyncio
import math
import time

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
