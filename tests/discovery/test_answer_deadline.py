"""answer_within: etcd's answer waited for over this process's waking time, a stall of its own
(a paused VM, a long GC, a debugger) never read as etcd's silence."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from discovery.answer_deadline import answer_within


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
