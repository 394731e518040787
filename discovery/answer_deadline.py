"""A deadline for etcd's answer that a stall of this process does not spend.

A process stopped (a paused VM, SIGSTOP, a long GC, a debugger) or stuck in a long synchronous step
reads nothing: etcd's answers wait in its socket, and its own requests (a watch's progress
request, a lease's keep-alive) wait unsent. On waking, the event loop runs the timers due before
it reads the socket, so a plain `asyncio.timeout` fires and blames etcd for the process's own
stall (an audit of 2026-12-07: a router paused 6 s gave up three watches and its lease's stream,
"no answer from etcd"). `answer_within` measures, on the monotonic loop clock, how late its own
timer fires: late by as much as could explain a missing answer (half the wait, at most LATE_S)
means the process was stalled through the deadline, so it says so and waits RECHECK_S more (the
requests the stall held go out and are answered in a round trip), again after each such stall,
but no more than `seconds` in all, and never past `latest` (a lease's TTL, less a try on another
member). A busy loop's lag (timers late by a step or two, 0.15-0.3 s) is no such stall: re-waiting
for it with no limit kept a busy shim on a hung member past its lease's TTL (a review of
2026-12-07: 150 ms steps, 8 re-waits, never given up). It fails with TimeoutError when its timer
fires on time: etcd, not this process, did not answer; with `StalledPast`, a TimeoutError naming
the stall, when it fires late with no waiting left (its re-waits spent, or `latest` passed: a stall
longer than a lease's TTL), for its owner to name the stall, not etcd (an audit of 2026-12-07: a
shim stopped 10 s said "etcd does not answer" of its lease). Its LATE_S is not
`runtime.loop_watch`'s (0.1 s, a stall of the router's loop for its peers' silence): here a timer
must be late by as much as could have kept an answer unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator

__all__ = ["LATE_S", "RECHECK_S", "StalledPast", "answer_within"]

log = logging.getLogger(__name__)
LATE_S = 0.5  # a timer this late (or half its wait) found the loop stalled, not busy: that lags a step
RECHECK_S = 1.0  # after a stall: a request sent on waking, answered in a round trip


class StalledPast(TimeoutError):
    """The deadline came while this process stood still and no waiting was left: the answer missing
    is its stall's, not etcd's. `stalled_s`: how late its timer fired, the stall's least length."""

    def __init__(self, what: str, stalled_s: float) -> None:
        self.stalled_s = stalled_s
        super().__init__(f"{what}: this process was stalled {stalled_s:.1f}s or more through its deadline")


@contextlib.asynccontextmanager
async def answer_within(seconds: float, what: str, latest: float | None = None) -> AsyncIterator[None]:
    """TimeoutError when the block runs for `seconds` of this process's waking time: the deadline
    moves on by RECHECK_S (at most `seconds`) each time its timer fires min(seconds / 2, LATE_S) or
    more late, with an INFO line naming `what` waits and how long the process was stalled; by
    `seconds` in all at most, and never past `latest` (the loop's clock) when given. StalledPast
    when the timer that ends it fired that late."""
    deadline: _Deadline | None = None
    try:
        async with asyncio.timeout(None) as timeout:
            deadline = _Deadline(timeout, seconds, latest, what)
            try:
                yield
            finally:
                deadline.handle.cancel()
    except TimeoutError:
        if deadline is not None and deadline.stalled_s:  # set only as its own timer ended the block
            raise StalledPast(what, deadline.stalled_s) from None
        raise


class _Deadline:
    def __init__(self, timeout: asyncio.Timeout, seconds: float, latest: float | None, what: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._what = what
        self._recheck = min(RECHECK_S, seconds)
        self._late = min(seconds / 2, LATE_S)
        self._spare = seconds  # re-waits left, in seconds
        self._latest = math.inf if latest is None else latest
        self._due = self._loop.time() + seconds
        self.stalled_s = 0.0  # how late the timer that ended the block fired, when late enough for a stall
        self.handle = self._loop.call_at(self._due, self._expire)

    def _expire(self) -> None:
        now = self._loop.time()
        late = now - self._due
        wait = min(self._recheck, self._spare, self._latest - now)
        if late < self._late or wait <= 0:
            self.stalled_s = late if late >= self._late else 0.0
            self._timeout.reschedule(now)  # cancels the block now: TimeoutError (StalledPast when late)
            return
        log.info(
            "%s: this process was stalled %.1fs or more (not etcd): waiting %.2fs more for etcd's answer "
            "before blaming it",
            self._what,
            late,
            wait,
        )
        self._spare -= wait
        self._due = now + wait
        self.handle = self._loop.call_at(self._due, self._expire)
