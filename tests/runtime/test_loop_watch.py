"""LoopWatch: how long this process's loop has been awake, a stall of its own seen at once."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import pytest

from runtime import loop_watch
from runtime.loop_watch import TICK_S, LoopWatch

# Each test counts its loop's stalls of over LATE_S: a loaded box's scheduling makes stalls of its own
# (CI counted a fourth where a test made three), so these run in the serial pass.
pytestmark = pytest.mark.timing


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


async def test_older_stalls_count_up_to_older_at_most_and_the_latest_in_full() -> None:
    """router.eligibility's credit: of a dead worker's silence, the latest stall and the longest may
    hide its reports unread (the work on waking from a pause outlasts a tick: the pause is then the
    longest, not the latest), so the stalls besides count up to a limit (reviews of 2026-12-07)."""
    watch = LoopWatch()
    watch.start()
    try:
        await asyncio.sleep(0.2)
        for _ in range(3):
            time.sleep(0.3)
            await asyncio.sleep(3 * TICK_S)
        stalled = watch.stalled_within(10.0)
        assert watch.stalls == 3 and 0.9 <= stalled <= 0.9 + 6 * TICK_S
        # the latest and the longest (all 0.3 s: one of the two older ones) alone
        assert 0.6 <= watch.stalled_within(10.0, older_at_most=0.0) <= 0.6 + 4 * TICK_S
        assert 0.6 + 0.2 <= watch.stalled_within(10.0, older_at_most=0.2) <= 0.6 + 4 * TICK_S + 0.2
        time.sleep(0.4)  # a stall not yet seen is the latest: all three before it are older
        assert 0.4 + 0.3 + 0.2 <= watch.stalled_within(10.0, older_at_most=0.2) <= 0.9 + 4 * TICK_S
    finally:
        await watch.stop()


async def test_a_stall_of_a_second_or_more_is_said_once_a_minute_naming_those_between(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until 2026-12-07 a router paused 6 s said nothing of it: its lines blamed its workers and etcd."""
    watch = LoopWatch("this router")
    watch.start()
    try:
        await asyncio.sleep(3 * TICK_S)
        time.sleep(0.4)  # a busy loop's: not said
        await asyncio.sleep(3 * TICK_S)
        assert watch.stalls == 1 and not caplog.records
        time.sleep(1.2)
        await asyncio.sleep(3 * TICK_S)
        [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert re.match(r"this router's event loop was stalled 1\.[2-4]s; a paused VM", line), line
        time.sleep(1.1)  # within SAY_EVERY_S of the line: counted into the next
        await asyncio.sleep(3 * TICK_S)
        assert len(caplog.records) == 1
        monkeypatch.setattr(loop_watch, "SAY_EVERY_S", 0.0)
        time.sleep(1.0)
        await asyncio.sleep(3 * TICK_S)
        assert len(caplog.records) == 2
        line = caplog.records[1].getMessage()
        assert re.search(
            r"stalled 1\.[0-2]s \(1 more of 1s or longer since the last such line, the longest 1\.[1-3]s\)", line
        ), line
    finally:
        await watch.stop()


async def test_a_watch_whose_task_ended_reports_no_stall() -> None:
    """A watch that no longer ticks (its task crashed, or was cancelled) says nothing of the loop:
    until a review of 2026-12-07 all the time since its last tick read as a stall, so a shim whose
    loop watch had crashed named its own stall, "not etcd or the network", of every later cut-off."""
    watch = LoopWatch()
    watch.start()
    try:
        await asyncio.sleep(0.2)
        task = watch.task
        assert task is not None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.5)  # awake all along
        assert watch.stalled_within(10.0) == 0.0
        assert watch.awake_for() == math.inf
    finally:
        await watch.stop()
    assert watch.stalled_within(10.0) == 0.0 and watch.awake_for() == math.inf  # stopped: the same


class _Clock:
    def time(self) -> float:
        return 10.0


class _Running:
    """A watch's task that runs on."""

    def done(self) -> bool:
        return False


def test_one_stall_clipped_by_until_with_no_older_credit_is_its_own_part() -> None:
    # the clipping's rounding left the older total a hair over a cap of 0 with no older stall: the
    # longest's max() ran over nothing and raised (a review of 2026-12-07)
    watch = LoopWatch()
    watch._loop, watch._ticked = _Clock(), 10.0  # type: ignore[assignment]  # ticked now: none unseen
    watch._task = _Running()  # type: ignore[assignment]
    start, end = 2.4798028269513908, 6.999628782304185
    watch._starts, watch._ends, watch._sums = [start], [end], [end - start]
    until = 4.16183472797762
    assert watch.stalled_within(25.70739835284071, until, older_at_most=0.0) == pytest.approx(until - start)
