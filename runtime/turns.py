"""`Turns`: give the event loop a turn once a slice of work has run since the last.

Awaiting what is ready already never yields: a socket that holds messages, a NATS subscription whose
queue is full (nats-py runs its callbacks one after another from one task), a synchronous sink. A
backlog is then worked through in one turn of the loop, whatever it costs, while every other task
(streams, heartbeats, /health) waits. Taking a turn every `slice_s` bounds that hold.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["SLICE_S", "Turns"]

SLICE_S = 0.005


class Turns:
    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._since = time.perf_counter()

    async def take(self) -> None:
        """A turn for the loop when `slice_s` has passed since the last one taken here."""
        if time.perf_counter() - self._since >= self.slice_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()
