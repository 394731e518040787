"""Admission: while every worker that could take a request is over the queue threshold, requests
wait here, first come first served; when `max_queue` are already waiting, a new one is refused
(HTTP 429 with Retry-After).

A waiter re-checks on `notify()` (a request finished, a worker appeared) and at least every
`poll_s`, since load reports from shims and other replicas arrive without a hook into this queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["Admission", "QueueFull", "QueueTimeout"]


class QueueFull(Exception):
    def __init__(self, depth: int, retry_after_s: int) -> None:
        self.depth = depth
        self.retry_after_s = retry_after_s
        super().__init__(f"all workers are busy and {depth} requests are already queued")


class QueueTimeout(Exception):
    def __init__(self, waited_s: float) -> None:
        self.waited_s = waited_s
        super().__init__(f"no worker became free within {waited_s:.1f}s")


class Admission:
    def __init__(self, max_queue: int, *, poll_s: float = 0.05, retry_after_s: int = 1) -> None:
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._poll_s = poll_s
        self._waiting = 0
        self._tick: asyncio.Future[None] | None = None

    @property
    def depth(self) -> int:
        return self._waiting

    def notify(self) -> None:
        tick, self._tick = self._tick, None
        if tick is not None and not tick.done():
            tick.set_result(None)

    async def admit(self, is_open: Callable[[], bool], timeout_s: float) -> None:
        """Return once `is_open()`; raise QueueFull at once if the queue is full, QueueTimeout
        when `timeout_s` passes first."""
        if is_open():
            return
        if self._waiting >= self.max_queue:
            raise QueueFull(self._waiting, self.retry_after_s)
        start = time.monotonic()
        self._waiting += 1
        try:
            while not is_open():
                remaining = timeout_s - (time.monotonic() - start)
                if remaining <= 0:
                    raise QueueTimeout(timeout_s)
                if self._tick is None:
                    self._tick = asyncio.get_running_loop().create_future()
                await asyncio.wait([self._tick], timeout=min(remaining, self._poll_s))
        finally:
            self._waiting -= 1
