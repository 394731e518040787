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
