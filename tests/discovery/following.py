"""Following a worker watch in tests: its events applied to a dict, as the router's registry does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from discovery import Deleted, Put, Snapshot, WatchEvent
from protocol import WorkerInfo


async def follow(
    watch: AsyncGenerator[WatchEvent[WorkerInfo], None],
    held: dict[str, WorkerInfo],
    done: Callable[[dict[str, WorkerInfo]], bool],
    timeout: float,
) -> list[WatchEvent[WorkerInfo]]:
    """Apply the watch's events to `held` until `done(held)`; the events seen."""
    seen: list[WatchEvent[WorkerInfo]] = []
    async with asyncio.timeout(timeout):
        while not done(held):
            event = await anext(watch)
            seen.append(event)
            match event:
                case Snapshot(items=items):
                    held.clear()
                    held.update(items)
                case Put(name=name, value=info):
                    held[name] = info
                case Deleted(name=name):
                    held.pop(name, None)
    return seen
