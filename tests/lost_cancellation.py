"""A call below a task that swallows its first cancellation (grpc.aio, Python 3.11's asyncio, a
library's `except BaseException`), and a stop waited on without passing it a cancellation: a full
test run of 2026-12-07 hung for good in a stop that cancelled its task once and waited."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from runtime import cancel_and_wait


async def never_answers(lost: list[str], what: str) -> None:
    """A call that never answers; the first cancellation of `what`'s is swallowed (noted in `lost`),
    as a call below a task can, and the call returns as if it had answered."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        if what in lost:
            raise
        lost.append(what)


async def ends_within(stop: Coroutine[Any, Any, object], seconds: float) -> bool:
    """Whether `stop` ends within `seconds`, waited for without cancelling it: asyncio.timeout's
    cancellation would reach the task it waits on, a second one, and end it, hiding a stop that
    waits for good. One still waiting is cancelled until it ends (not left to the next test)."""
    task = asyncio.create_task(stop, name="stop")
    await asyncio.wait({task}, timeout=seconds)
    if not task.done():
        await cancel_and_wait(task, again_s=0.1)
        return False
    task.result()
    return True


async def runs_on(lost: list[str], what: str) -> None:
    """A task's loop whose call loses its first cancellation (`never_answers`): it ends at the second."""
    while True:
        await never_answers(lost, what)


async def cut_while_it_waits(stop: Coroutine[Any, Any, object], lost: list[str], what: str) -> asyncio.Task[object]:
    """`stop` run as a task and cancelled once its wait (cancel_and_wait) has a task `runs_on` in it
    that lost its first cancellation (`what` in `lost`): as the stop that waits on a cancelled
    task's cleanup cancels that cleanup again. The stop's task, ended."""
    task: asyncio.Task[object] = asyncio.create_task(stop, name="cut-stop")
    for _ in range(1000):
        if what in lost:
            break
        await asyncio.sleep(0.001)
    assert what in lost, f"{what} was never cancelled"
    task.cancel()
    await asyncio.wait({task}, timeout=10)
    assert task.done(), "the stop still waits"
    return task
