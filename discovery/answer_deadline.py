"""A deadline for etcd's answer that a stall of this process does not spend.

A process stopped (a paused VM, SIGSTOP, a long GC, a debugger) or stuck in a long synchronous step
reads nothing: etcd's answers wait in its socket, and its own requests (a watch's progress
request, a lease's keep-alive) wait unsent. On waking, the event loop runs the timers due before
it reads the socket, so a plain `asyncio.timeout` fires and blames etcd for the process's own
stall (an audit of 2026-12-07: a router paused 6 s gave up three watches and its lease's stream,
"no answer from etcd"). `answer_within` measures, on the monotonic loop clock, how late its own
timer fires: one LATE_S or more past its time means the process was stalled through the deadline,
so it says so and waits RECHECK_S more (the requests the stall held go out and are answered in a
round trip), again after each such stall, and fails with TimeoutError only when it fires on time:
etcd, not this process, did not answer. The same measure in `runtime.loop_watch` (LATE_S there) is
the router's; discovery keeps its own, as it is used from below the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

__all__ = ["LATE_S", "RECHECK_S", "answer_within"]

log = logging.getLogger(__name__)
LATE_S = 0.1  # a timer firing this late found the loop stalled (a busy loop runs them within ms)
RECHECK_S = 1.0  # after a stall: a request sent on waking, answered in a round trip


@contextlib.asynccontextmanager
async def answer_within(seconds: float, what: str) -> AsyncIterator[None]:
    """TimeoutError when the block runs for `seconds` of this process's waking time: the deadline
    moves on by RECHECK_S (at most `seconds`) each time its timer fires LATE_S or more late, with an
    INFO line naming `what` waits and how long the process was stalled."""
    async with asyncio.timeout(None) as timeout:
        deadline = _Deadline(timeout, seconds, what)
        try:
            yield
        finally:
            deadline.handle.cancel()


class _Deadline:
    def __init__(self, timeout: asyncio.Timeout, seconds: float, what: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._what = what
        self._recheck = min(RECHECK_S, seconds)
        self._due = self._loop.time() + seconds
        self.handle = self._loop.call_at(self._due, self._expire)

    def _expire(self) -> None:
        now = self._loop.time()
        late = now - self._due
        if late < LATE_S:
            self._timeout.reschedule(now)  # cancels the block now: TimeoutError
            return
        log.info(
            "%s: this process was stalled %.1fs or more (not etcd): waiting %.1fs more for etcd's answer "
            "before blaming it",
            self._what,
            late,
            self._recheck,
        )
        self._due = now + self._recheck
        self.handle = self._loop.call_at(self._due, self._expire)
