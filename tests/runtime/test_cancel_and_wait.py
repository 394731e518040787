"""`runtime.cancel_and_wait`: a task whose cancellation is lost below it (Python 3.11's asyncio and
grpc.aio each can drop one) is cancelled again until it ends; a stop no longer waits on it for good."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

import runtime
from runtime import cancel_and_wait
from tests.lost_cancellation import ends_within


async def _swallows(times: int, ticks: list[int]) -> None:
    """Loops as a supervisor does, losing its first `times` cancellations as a call below it can."""
    while True:
        try:
            await asyncio.sleep(0.01)
            ticks.append(1)
        except asyncio.CancelledError:
            if times == 0:
                raise
            times -= 1


@pytest.mark.parametrize("lost", [0, 1, 2])
async def test_a_task_that_loses_its_cancellations_is_cancelled_until_it_ends(
    lost: int, caplog: pytest.LogCaptureFixture
) -> None:
    ticks: list[int] = []
    task = asyncio.create_task(_swallows(lost, ticks), name="supervisor")
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert await ends_within(cancel_and_wait(task, again_s=0.05), 10)
    assert task.cancelled()
    said = [r.getMessage() for r in caplog.records if r.name == "runtime"]
    if lost:
        assert said == [
            f"task supervisor ran on through its cancellation (lost below it): cancelled again {lost} time(s) "
            "before it ended"
        ], said
    else:
        assert said == []


async def test_a_crash_is_retrieved_not_raised() -> None:
    async def crash() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(crash())
    await asyncio.sleep(0)
    await cancel_and_wait(task)  # no "exception was never retrieved", no raise
    assert isinstance(task.exception(), RuntimeError)


async def test_a_caller_cancelled_meanwhile_cancels_the_task_again() -> None:
    """A review of 2026-12-07: awaiting the task passed the caller's cancellation on to it; the
    wait did not, and a task that had lost its first cancellation ran on, orphaned."""
    ticks: list[int] = []
    task = asyncio.create_task(_swallows(1, ticks))
    await asyncio.sleep(0.05)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await cancel_and_wait(task, again_s=10.0)
    await asyncio.sleep(0.05)
    assert task.cancelled()


async def test_a_caller_cancelled_meanwhile_waits_for_the_task_then_raises() -> None:
    """As awaiting the task did: the caller's cancellation goes on to it, and the caller's wait to
    its end (a cleanup of 0.3 s here, that no cancellation cuts: a library's own) before
    CancelledError. It was raised at once (a review of 2026-12-07), the task still cleaning up: a
    stop within a stop was cut off there."""
    cleaned: list[bool] = []

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.01)
            cleaned.append(True)

    task = asyncio.create_task(cleans_up())
    await asyncio.sleep(0.05)
    stop = asyncio.create_task(cancel_and_wait(task, again_s=10.0))
    await asyncio.sleep(0.05)
    stop.cancel()
    await asyncio.wait({stop}, timeout=5)
    assert stop.cancelled() and task.cancelled() and cleaned == [True]


async def test_a_stop_within_a_stop_is_not_cut_off_and_names_the_task_that_ran_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A task whose cleanup waits on another (cancel_and_wait), that one losing its cancellations:
    the stop waiting on the first cancels it again every again_s, and the first such cancellation
    came to the inner wait, which raised at once, its task running on, the WARNING naming the outer
    task. Each is now passed on to the task that runs on and counted against it, and the inner wait
    lasts until that task ended (then raised: what comes after it in the cleanup is run by a
    `finally`, or runtime.StopSteps)."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)
    ticks: list[int] = []
    inner = asyncio.create_task(_swallows(2, ticks), name="inner")
    ended: list[bool] = []

    async def outer() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            try:
                await cancel_and_wait(inner)
            finally:
                ended.append(inner.done())

    task = asyncio.create_task(outer(), name="outer")
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert await ends_within(cancel_and_wait(task, again_s=0.2), 10)
    assert task.cancelled() and inner.cancelled() and ended == [True]
    said = [r.getMessage() for r in caplog.records if r.name == "runtime"]
    assert said == [
        "task inner ran on through its cancellation (lost below it): cancelled again 2 time(s) before it ended"
    ], said


async def test_a_group_is_cancelled_until_each_ends_and_each_that_ran_on_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stop that cancels a set of tasks (a router's loops, a reporter's two) waits for them all,
    each cancelled again while it runs on; the WARNING names each that had to be, and no other."""
    ticks: list[int] = []
    tasks = [asyncio.create_task(_swallows(lost, ticks), name=f"loop-{lost}") for lost in (0, 1, 2)]
    await asyncio.sleep(0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="runtime"):
            assert await ends_within(cancel_and_wait(*tasks, again_s=0.05), 10)
    finally:
        for task in tasks:  # one by one: not left looping into the loop's close, should the group fail
            await cancel_and_wait(task, again_s=0.05)
    assert all(t.cancelled() for t in tasks)
    said = sorted(r.getMessage() for r in caplog.records if r.name == "runtime")
    assert said == [
        f"task loop-{lost} ran on through its cancellation (lost below it): cancelled again {lost} time(s) "
        "before it ended"
        for lost in (1, 2)
    ], said


async def test_a_group_of_none_is_no_wait() -> None:
    async with asyncio.timeout(1):
        await cancel_and_wait()
