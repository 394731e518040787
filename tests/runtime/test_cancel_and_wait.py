"""`runtime.cancel_and_wait`: a task whose cancellation is lost below it (Python 3.11's asyncio and
grpc.aio each can drop one) is cancelled again until it ends; a stop no longer waits on it for good."""

from __future__ import annotations

import asyncio
import logging

import pytest

from runtime import cancel_and_wait


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
        async with asyncio.timeout(10):
            await cancel_and_wait(task, again_s=0.05)
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
            async with asyncio.timeout(10):
                await cancel_and_wait(*tasks, again_s=0.05)
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
