"""A task that runs for its owner's life says at once when it crashes, not at the owner's stop()."""

from __future__ import annotations

import asyncio
import logging

import pytest

from runtime import background


async def test_a_crash_is_an_error_at_once_with_its_traceback_and_what_stops(caplog: pytest.LogCaptureFixture) -> None:
    async def loop() -> None:
        await asyncio.sleep(0)
        raise ValueError("cannot convert float NaN to integer")

    with caplog.at_level(logging.ERROR, logger="runtime"):
        task = background(loop(), "load-w1", "no load report is sent")
        await asyncio.wait({task})
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    (said,) = [r for r in caplog.records if r.name == "runtime"]
    assert said.getMessage() == "task load-w1 crashed: no load report is sent until this process restarts"
    assert said.exc_info is not None and isinstance(said.exc_info[1], ValueError)


async def test_a_cancelled_or_finished_task_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def done() -> None:
        return None

    with caplog.at_level(logging.DEBUG, logger="runtime"):
        stopped = background(forever(), "a", "a")
        finished = background(done(), "b", "b")
        await asyncio.sleep(0)
        stopped.cancel()
        await asyncio.wait({stopped, finished})
        await asyncio.sleep(0)
    assert [r for r in caplog.records if r.name == "runtime"] == []
