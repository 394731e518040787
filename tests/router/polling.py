"""Waiting for a state the system under test must reach, in the router's async tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Return once `cond()` holds; fail naming `what` after `timeout`. Polled: the counters and
    views it reads have no event to wait on, and adding one only for tests is not worth it."""
    try:
        async with asyncio.timeout(timeout):
            while not cond():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}") from None
