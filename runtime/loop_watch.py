"""How long this process's event loop has been awake: a stall of its own is no silence of its peers.

A process that judges a peer silent by the age of its last message (a router its workers, by their
load reports) misjudges after a stall of its own (a GC pause, a long synchronous step): the
messages that came meanwhile wait unread in the socket, and libuv runs due timers, and the tasks
they wake, before it reads them. `LoopWatch` ticks every TICK_S; a tick that comes more than LATE_S
late marks a stall, and `awake_for()` is the time since the last one ended (0 while a stall is
still unseen: the watch has not ticked for longer than it should). A leg waits for its worker's next
chunk until the loop has been awake for its silence window (`awake_for`, router.leg); a report's
age is read less the stalls within it (`stalled_within`, below).

It keeps the spans of its stalls of the last STALLS_KEPT_S (from the last tick on time to the late
one: at most one per TICK_S + LATE_S, so a few hundred), and `stalled_within(seconds)` says how long
the loop stood still in the last `seconds`, a stall still unseen included: of a message's age, the
part it may have waited unread through a stall of ours (router.clock_skew credits it so);
`older_at_most` caps what the stalls besides the latest and the longest count (router.eligibility:
of a dead worker's silence, those two may hide reports not yet read). A running sum of the time
stalled beside the spans makes the total a bisection, O(log n): it runs per request per silent
worker, and walking the spans in Python took 71 us with 400 of them (a review of 2026-12-07); past
the cap the longest is one pass in C over the spans within the age. Older stalls are
forgotten, bounding the memory; a message older than that is read as if it had come through them
awake.

A stall of SAY_S or more is said at WARNING, one line per SAY_EVERY_S naming those between: it
is the one line that says this process, not its peers, stood still (router.eligibility counts a
worker silent only on the rest of its report's age, discovery.answer_deadline waits again for etcd).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
from operator import sub

from runtime import background

__all__ = ["LATE_S", "STALLS_KEPT_S", "TICK_S", "LoopWatch"]

TICK_S = 0.05
LATE_S = 0.1
log = logging.getLogger(__name__)
SAY_S = 1.0  # a stall this long is said, at WARNING: a shorter one is a busy loop's, and routine
SAY_EVERY_S = 60.0  # one such line at most this often; the stalls between are counted into the next
STALLS_KEPT_S = 60.0  # as long as the longest report period (protocol.config.MAX_LOAD_PERIOD_S)


class LoopWatch:
    def __init__(self, who: str = "this process") -> None:
        self._who = who  # its owner, as its WARNING names it
        self._said = -math.inf  # when a stall was last said
        self._unsaid, self._unsaid_longest = 0, 0.0  # stalls of SAY_S or more since, not said: too soon
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._awake_since = -math.inf
        self._ticked = -math.inf
        # Its stalls on the loop's clock, oldest first, from index _first on (those before it are
        # forgotten, dropped in bulk): start, end, and the time stalled up to each end since start.
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._sums: list[float] = []
        self._first = 0
        self.stalls = 0  # stalls seen since start

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._awake_since = self._ticked = loop.time()
        self._task = background(self._run(), "loop-watch", "stalls of this process count as its peers' silence")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Its loop, while started: should it end (runtime.ended), a router's readiness names it and a
        shim starts it again; meanwhile no stall is said (`stalled_within` 0, `awake_for` inf)."""
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _watching(self) -> bool:
        """Whether its task runs: one that ended (stopped, or crashed) has not ticked since, and the
        time since its last tick is no stall (until a review of 2026-12-07 all of it read as one)."""
        return self._task is not None and not self._task.done()

    def awake_for(self) -> float:
        """Seconds since this loop last came out of a stall; inf while not watching (nothing to say)."""
        loop = self._loop
        if loop is None or not self._watching():
            return math.inf
        now = loop.time()
        if now - self._ticked > TICK_S + LATE_S:
            return 0.0  # stalled until now: the watch has not run since
        return now - self._awake_since

    def stalled_within(self, seconds: float, until: float | None = None, *, older_at_most: float = math.inf) -> float:
        """Seconds this loop stood still within the `seconds` before `until` (its clock, loop.time();
        now when None), a stall not yet ticked included; of the stalls before the latest one there,
        the longest in full and the others `older_at_most` at most. 0 while not watching (not
        started, stopped, or its task crashed)."""
        loop = self._loop
        if loop is None or not self._watching():
            return 0.0
        now = loop.time()
        end = now if until is None else min(until, now)
        start = end - seconds
        latest = 0.0
        if now - self._ticked > TICK_S + LATE_S:  # stalled until now: the watch has not run since
            latest = max(0.0, end - max(self._ticked, start))
        first = bisect.bisect_right(self._ends, start, self._first)  # the first to end after start
        last = bisect.bisect_left(self._starts, end, first) - 1  # the last to start before end
        if last < first:
            return latest
        older = self._sums[last] - self._sums[first] + self._ends[first] - self._starts[first]
        older -= max(0.0, start - self._starts[first]) + max(0.0, self._ends[last] - end)  # clipped
        upto = last + 1  # the older stalls are first..upto-1
        if not latest:
            latest = min(self._ends[last], end) - max(self._starts[last], start)
            older -= latest
            upto = last
        if older <= older_at_most or upto == first:  # upto == first: clipping's rounding, no older one
            return latest + max(older, 0.0) if upto > first else latest
        # The longest is credited in full: a pause whose reports still wait unread is "older" once a
        # burst of work on waking (planning the queued requests) outlasts a tick (review of c244125).
        # Only the first and last may be clipped; the spans between are whole (map(sub) runs in C).
        ends, starts = self._ends, self._starts
        longest = max(
            min(ends[first], end) - max(starts[first], start),
            min(ends[upto - 1], end) - max(starts[upto - 1], start),
            max(map(sub, ends[first + 1 : upto - 1], starts[first + 1 : upto - 1]), default=0.0),
        )
        return latest + longest + min(older - longest, older_at_most)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            if now - self._ticked > TICK_S + LATE_S:
                self._awake_since = now
                self.stalls += 1
                self._starts.append(self._ticked)
                self._ends.append(now)
                self._sums.append((self._sums[-1] if self._sums else 0.0) + now - self._ticked)
                self._say(now, now - self._ticked)
                self._forget(now - STALLS_KEPT_S)
            self._ticked = now

    def _forget(self, before: float) -> None:
        """Forgets the stalls that ended before `before`, moving the lists once half of each is so."""
        self._first = bisect.bisect_left(self._ends, before, self._first)
        if self._first > len(self._ends) // 2:
            del self._starts[: self._first], self._ends[: self._first], self._sums[: self._first]
            self._first = 0

    def _say(self, now: float, stalled: float) -> None:
        """A WARNING for a stall of SAY_S or more, one per SAY_EVERY_S, naming those left unsaid since:
        nothing else says this process stood still (its peers' lines blame them, not it)."""
        if stalled < SAY_S:
            return
        if now - self._said < SAY_EVERY_S:
            self._unsaid += 1
            self._unsaid_longest = max(self._unsaid_longest, stalled)
            return
        more = ""
        if self._unsaid:
            more = (
                f" ({self._unsaid} more of {SAY_S:g}s or longer since the last such line, "
                f"the longest {self._unsaid_longest:.1f}s)"
            )
        self._said, self._unsaid, self._unsaid_longest = now, 0, 0.0
        log.warning(
            "%s's event loop was stalled %.1fs%s; a paused VM or container, a long GC pause, a debugger or a "
            "long synchronous step: what its peers sent meanwhile waited unread, and their silence over it "
            "is not counted against them",
            self._who,
            stalled,
            more,
        )
