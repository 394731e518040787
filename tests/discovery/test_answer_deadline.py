"""answer_within: etcd's answer waited for over this process's waking time, a stall of its own
(a paused VM, a long GC, a debugger) never read as etcd's silence."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from discovery.answer_deadline import StalledPast, answer_within


async def test_a_stall_through_the_deadline_waits_again_for_the_answer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "discovery.answer_deadline")
    async with answer_within(0.2, "watch /x/"):
        time.sleep(0.5)  # the process stopped past its deadline
        await asyncio.sleep(0.1)  # the answer, read once awake
    assert "watch /x/: this process was stalled 0.3s or more (not etcd)" in caplog.text


async def test_no_answer_on_waking_times_out_after_the_recheck() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with answer_within(0.2, "lease 1"):
            time.sleep(0.5)
            await asyncio.sleep(5)
    assert 0.5 + 0.2 <= time.monotonic() - started < 2.0  # the recheck is at most `seconds`


async def test_an_awake_process_times_out_on_time() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with answer_within(0.2, "lease 1"):
            await asyncio.sleep(5)
    assert 0.2 <= time.monotonic() - started < 0.3


async def _hung_while_busy(step: float, seconds: float, latest_in: float | None = None) -> float:
    """Seconds answer_within(seconds) takes to give up on an answer that never comes while the loop
    runs `step`-long synchronous steps back to back (busy, never paused); 10 when it does not."""

    async def busy() -> None:
        while True:
            time.sleep(step)
            await asyncio.sleep(0)

    loop = asyncio.get_running_loop()
    task = asyncio.create_task(busy())
    started = time.monotonic()
    deadline = answer_within(seconds, "lease 1")
    if latest_in is not None:
        deadline = answer_within(seconds, "lease 1", latest=loop.time() + latest_in)
    try:
        async with asyncio.timeout(10):  # the test's own guard
            with pytest.raises(TimeoutError):
                async with deadline:
                    await loop.create_future()  # etcd that never answers
        return time.monotonic() - started
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_busy_loop_lag_is_no_stall(caplog: pytest.LogCaptureFixture) -> None:
    # A timer runs a step or two late (0.15-0.3 s) on such a loop: until 2026-12-07 each counted as
    # a stall (0.1 s or more) and the answer was waited for again and again, never given up. The
    # TimeoutError itself reaches the block two steps later.
    caplog.set_level(logging.INFO, "discovery.answer_deadline")
    assert await _hung_while_busy(0.15, 1.0) < 1.0 + 4 * 0.15 + 0.2
    assert "stalled" not in caplog.text


async def test_a_loop_stalling_again_and_again_waits_again_no_more_than_the_wait() -> None:
    # Steps of 0.25 s make each timer 0.25-0.5 s late, past half of the 0.4 s wait: one re-wait of
    # 0.4 s, then given up, where each such stall moved the deadline on with no limit.
    assert await _hung_while_busy(0.25, 0.4) < 0.4 + 0.5 + 0.4 + 0.5 + 2 * 0.25 + 0.2


async def test_re_waits_end_by_latest() -> None:
    # A lease's: HURRY_S before its TTL, so another member may still renew it.
    assert await _hung_while_busy(0.25, 0.4, latest_in=0.5) < 0.5 + 0.5 + 2 * 0.25 + 0.2


async def test_a_stall_past_latest_fails_naming_the_stall() -> None:
    """A stall longer than a lease's TTL leaves no re-wait (`latest` passed): until 2026-12-07 its
    plain TimeoutError read as etcd's silence ("etcd does not answer")."""
    loop = asyncio.get_running_loop()
    with pytest.raises(StalledPast) as raised:
        async with answer_within(0.2, "lease 1", latest=loop.time() + 0.3):
            time.sleep(0.5)  # the process stopped past its deadline and past `latest`
            await asyncio.sleep(5)
    assert raised.value.stalled_s >= 0.3 - 0.01
    assert str(raised.value).startswith("lease 1: this process was stalled 0.")


async def test_an_awake_process_timing_out_names_no_stall() -> None:
    with pytest.raises(TimeoutError) as raised:
        async with answer_within(0.2, "lease 1"):
            await asyncio.sleep(5)
    assert not isinstance(raised.value, StalledPast)
