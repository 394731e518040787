"""How long this process's event loop has been awake: a stall of its own is no silence of its peers.

A process that judges a peer silent by the age of its last message (a router its workers, by their
load reports) misjudges after a stall of its own (a GC pause, a long synchronous step): the
messages that came meanwhile wait unread in the socket, and libuv runs due timers, and the tasks
they wake, before it reads them. `LoopWatch` ticks every TICK_S; a tick that comes more than LATE_S
late marks a stall, and `awake_for()` is the time since the last one ended (0 while a stall is
still unseen: the watch has not ticked for longer than it should). A peer is silent for what the
process could have heard: the lesser of its message's age and `awake_for()`.
"""

from __future__ import annotations

import asyncio
import math

from runtime import background

__all__ = ["LATE_S", "TICK_S", "LoopWatch"]

TICK_S = 0.05
LATE_S = 0.1


class LoopWatch:
    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._awake_since = -math.inf
        self._ticked = -math.inf
        self.stalls = 0  # stalls seen since start

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._awake_since = self._ticked = loop.time()
        self._task = background(self._run(), "loop-watch", "stalls of this process count as its peers' silence")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Its loop, while started: its owner's readiness names it should it end (runtime.ended)."""
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def awake_for(self) -> float:
        """Seconds since this loop last came out of a stall; inf when not started (nothing to say)."""
        loop = self._loop
        if loop is None:
            return math.inf
        now = loop.time()
        if now - self._ticked > TICK_S + LATE_S:
            return 0.0  # stalled until now: the watch has not run since
        return now - self._awake_since

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            if now - self._ticked > TICK_S + LATE_S:
                self._awake_since = now
                self.stalls += 1
            self._ticked = now
