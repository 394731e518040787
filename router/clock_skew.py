"""Whether each worker's clock agrees with this router's.

Router and shims compare wall-clock times across hosts: a request's `deadline` goes to the shim
as Unix time and the shim checks it, and a load report's stamp decides when a booking hands over
to the reports (router.load_view). A worker whose clock is off has its stamps clamped (ahead) or
double counts bookings (behind), and would expire deadlines early or late by its offset (ahead by
`--request-timeout`, every request it got was a 504 "deadline passed"), so the router sends each
deadline on the worker's clock (router.dispatch: the deadline plus the offset of a worker judged
off) and says the offset (a WARNING, a gauge).

The offset is read from load reports, stamped when sent: (stamp - receipt) is the worker's offset
minus the transit. Transit only delays, so the largest of the last WINDOW readings is the best
estimate: one report stamped ahead is proof, while a clock is judged behind only when WINDOW
reports in a row are. A worker judged off agrees again only within AGREE_FRACTION of the
tolerance: one whose offset sits at the tolerance flipped on every few milliseconds of transit
jitter, a WARNING and an INFO a minute and its gauge series coming and going.

A delay only ever makes a worker look behind, never ahead, so a report stamped behind is read for
the part of its age that cannot be a wait of ours:
- One that arrives less than half as long after the worker's last one as it was stamped after it
  waited in a queue on the way, and is not read (the first of such a burst is): a shim's NATS
  reconnect buffer sent in one burst once NATS is back (a shim older than 2026-12-06 kept its
  reports there through an outage). Its offset is that wait, not the clock: after any outage over
  WINDOW periods such bursts judged every worker's clock behind by the outage's length. Judged on
  the receipts as they came: a credit (below) growing report by report would read as a burst.
- Its age is read less the time this router's loop stood still within it (runtime.loop_watch's
  `stalled_within`, up to the receipt), never past agreeing: it may have waited that long unread
  in our socket. Read whole, the first of each backlog a stall queues made a loop stopped 5 s at a
  time judge a healthy worker on its own host 4.5-5 s behind after three stalls (audit of
  2026-12-07): every deadline sent to it 4.5 s short, a 504 at 15.2 s of a 20 s timeout. Credited,
  those read about 0. Until the review of 2026-12-07 such a report was not read unless the loop had
  been awake for its age or WINDOW of its periods: a router stalling 0.2 s every 1-2 s read none,
  and a worker 3-5 s behind was never judged.
So behind needs more evidence than ahead: WINDOW reports in a row, each with our stalls taken off
its age, where one report stamped ahead is proof. The cost falls on the harmless side: the credit
is every stall within the age the stamp shows, its offset included, so a worker behind is judged
short by our stalls within its offset (1.2 s of 5 s, 0.2 s stalls every 1.2 s), and one behind by
less than those reads as agreeing: its deadlines expire later there than here (this router ends the
request at its own). One judged behind falsely has every deadline expire early there, a 504 before
its time, and a WARNING sends the operator to a clock that is right. A backlog still unread after
the loop woke, its wait no stall (the loop ticking as it reads a large fleet's), is a wait this
module cannot tell from a clock behind; the largest of WINDOW readings is the estimate.

What is said (SkewNews) is judged over the fleet, not worker by worker: when this router's clock is
the one off (or the fleet's), every worker is off by about the same offset: until 2026-12-06 1,000
workers gave 1,000 WARNINGs, each telling the operator to fix that worker's NTP. The changes of a burst
are held until SETTLE_REPORTS report periods after its first (time for every worker's WINDOW reports
to come), then judged together: when more than half of the workers whose offset is known, and at
least FLEET_AT_LEAST, are off by offsets within AGREE_FRACTION of the tolerance of their median, the
fleet is said (this router's clock is probably off), and only the workers off on their own are named.
The fleet is said again only when the verdict changed in substance: judged off or no longer, its
offset moved by more than AGREE_FRACTION of the tolerance, or fewer than half of its workers were in
the last verdict's. Workers leaving are judged too, held as a burst is (a 1,000-worker redeploy is a
judgement a settle, not one a removal). Until 2026-12-06 they were not, and verdicts were compared
as None or not: a fleet judged off that left (a redeploy) kept its verdict, no INFO came, and a
later fleet-wide skew (this router's clock stepping) counted as unchanged, said nowhere, every
worker covered by the stale verdict. A verdict ends only when clocks are seen to agree with this
router's: one that finds no fleet because the fleet shrank below FLEET_AT_LEAST, or was replaced
and no new offset is known yet (judged again once they may be), stands, over the workers still off
alike; before, either said this router's clock agreed again, then named each worker left or said the
fleet anew. At most SAY_AT_MOST workers are named per judgement, the rest
counted; a worker is said to agree again only if it was said off. With fewer than FLEET_AT_LEAST
workers registered, no fleet can outvote one: a change is said at once. Registered, not heard from:
until 2026-12-06 the first two workers to report to a router started with its clock off were each
named on their own before the fleet was said.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.config import MAX_LOAD_PERIOD_S
from router.fleet_lines import NAMED_AT_MOST

__all__ = [
    "AGREE_FRACTION",
    "FLEET_AT_LEAST",
    "SAY_AT_MOST",
    "SETTLE_REPORTS",
    "WINDOW",
    "ClockSkew",
    "Fleet",
    "Skew",
    "SkewNews",
    "Verdict",
]

WINDOW = 3
AGREE_FRACTION = 0.5
FLEET_AT_LEAST = 3
SAY_AT_MOST = NAMED_AT_MOST  # as every message naming workers: router.fleet_lines
SETTLE_REPORTS = WINDOW + 1


@dataclass(slots=True)
class Skew:
    """A worker whose offset crossed the tolerance (or came back within it)."""

    worker: str
    offset_s: float  # its clock minus ours: positive is ahead
    skewed: bool


@dataclass(slots=True)
class _Readings:
    offsets: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    skewed: bool = False
    last: tuple[float, float] | None = None  # the last report's stamp and receipt


class ClockSkew:
    def __init__(self, tolerance_s: float) -> None:
        self.tolerance_s = tolerance_s
        self._workers: dict[str, _Readings] = {}

    def observe(
        self, worker: str, stamped: float, received: float, stalled_within: Callable[[float], float]
    ) -> Skew | None:
        """One report's stamp and its receipt on our clock; `stalled_within(s)`: how long this router's
        loop stood still within the s seconds before the receipt (runtime.loop_watch). A Skew when the
        worker's state changed."""
        if not math.isfinite(stamped):  # a broken stamp says nothing of the clock
            return None
        r = self._workers.get(worker)
        if r is None:
            r = self._workers[worker] = _Readings()
        last, r.last = r.last, (stamped, received)
        if stamped < received:  # behind: its age less any wait of ours (module docstring)
            if last is not None and 0 <= received - last[1] < (stamped - last[0]) / 2:
                return None  # it waited in a queue on the way
            received = max(received - stalled_within(received - stamped), stamped)
        r.offsets.append(stamped - received)
        offset = max(r.offsets)
        limit = self.tolerance_s * (AGREE_FRACTION if r.skewed else 1.0)
        skewed = abs(offset) > limit and (offset > 0 or len(r.offsets) == WINDOW)
        if skewed == r.skewed:
            return None
        r.skewed = skewed
        return Skew(worker, offset, skewed)

    def offset(self, worker: str) -> float:
        """The worker's estimated offset when its clock is off, else 0: what a deadline sent to it
        is moved by, so that it expires there when it does here."""
        r = self._workers.get(worker)
        return max(r.offsets) if r is not None and r.skewed else 0.0

    def offsets(self) -> dict[str, float]:
        """Each worker's estimated offset, for the ones whose clock is off."""
        return {w: max(r.offsets) for w, r in self._workers.items() if r.skewed}

    def known(self) -> int:
        """How many workers' offsets are known: judged off, or a whole WINDOW read."""
        return sum(r.skewed or len(r.offsets) == WINDOW for r in self._workers.values())

    def remove(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def __len__(self) -> int:
        return len(self._workers)


@dataclass(slots=True)
class Fleet:
    """Most workers' clocks agree on an offset beyond the tolerance: this router's is probably off."""

    offset_s: float  # the agreeing workers' median offset, their clocks minus ours
    agreeing: list[str]  # sorted
    known: int  # workers whose offset is known (ClockSkew.known)


@dataclass(slots=True)
class Verdict:
    """What one judgement has to say."""

    fleet: Fleet | None  # the fleet's state now
    fleet_changed: bool  # the fleet's verdict changed in substance (SkewNews: the module docstring)
    off: list[Skew]  # workers judged off on their own, newly: at most SAY_AT_MOST
    off_more: int  # ... and how many more
    back: list[Skew]  # workers said off whose clock agrees again: at most SAY_AT_MOST
    back_more: int


class SkewNews:
    """The changes ClockSkew reports, held and judged over the fleet (module docstring). Times are
    monotonic: this router's wall clock may be the one that is off. `registered` counts the workers
    registered (cheap: read on every change heard)."""

    def __init__(self, clocks: ClockSkew, registered: Callable[[], int]) -> None:
        self.clocks = clocks
        self._registered = registered
        self._pending: dict[str, Skew] = {}  # the burst's changes, the latest per worker
        self._due: float | None = None
        self._period_s = 1.0  # the report period of the last change heard: a removal's hold is in it
        self._said: set[str] = set()  # workers said off on their own (named or counted)
        self._fleet: Fleet | None = None  # the last judgement's

    def heard(self, skew: Skew, now: float, period_s: float) -> None:
        """A change from `ClockSkew.observe`, seen in a report sent every `period_s`."""
        self._period_s = min(period_s, MAX_LOAD_PERIOD_S)
        if not self._pending:  # a burst's first change; a judgement a removal set waits for it
            self._due = now + self._hold()
        self._pending[skew.worker] = skew

    def due(self, now: float) -> Verdict | None:
        """The judgement of the burst once it has settled, else None (cheap: called per report)."""
        if self._due is None or now < self._due:
            return None
        pending, self._pending, self._due = self._pending, {}, None
        offsets, known, tolerance_s = self.clocks.offsets(), self.clocks.known(), self.clocks.tolerance_s
        fleet = _fleet(offsets, known, tolerance_s)
        if fleet is None and (was := self._fleet) is not None and _stands(offsets, known):
            # a fleet that shrank below FLEET_AT_LEAST, or was replaced and no new offset is known yet:
            # no clock was seen to agree with this router's, so its verdict stands, over who is still off alike
            close = sorted(w for w, o in offsets.items() if abs(o - was.offset_s) <= tolerance_s * AGREE_FRACTION)
            fleet, changed = Fleet(was.offset_s, close, known), False
            # judged again a settle later, and so on while it stands: offsets still to learn (a new
            # fleet's first reports), or workers joining with clocks that agree, which no change brings
            self._due = now + self._hold()
        else:
            changed = _moved(self._fleet, fleet, tolerance_s)
        self._fleet = fleet
        covered = set(fleet.agreeing) if fleet is not None else set()
        alone = {w: o for w, o in offsets.items() if w not in covered}
        off = [Skew(w, alone[w], True) for w in sorted(alone.keys() - self._said)]
        back = [pending[w] for w in sorted(self._said - offsets.keys()) if w in pending]
        self._said = set(alone)
        return Verdict(
            fleet, changed, off[:SAY_AT_MOST], len(off[SAY_AT_MOST:]), back[:SAY_AT_MOST], len(back[SAY_AT_MOST:])
        )

    def remove(self, worker: str, now: float) -> None:
        """A worker gone (after `ClockSkew.remove`): what was said is judged again, with the next
        burst or a settle after the first removal (a redeploy's removals are one judgement)."""
        self._pending.pop(worker, None)
        self._said.discard(worker)
        if self._due is None and (self._fleet is not None or self._said):  # else no clock is off: nothing to say
            self._due = now + self._hold()

    def _hold(self) -> float:
        """How long a burst is held: not at all where too few workers are registered to outvote one."""
        return SETTLE_REPORTS * self._period_s if self._registered() >= FLEET_AT_LEAST else 0.0


def _fleet(offsets: dict[str, float], known: int, tolerance_s: float) -> Fleet | None:
    """The fleet judged off, when more than half of the `known` workers, and FLEET_AT_LEAST, are
    off by offsets that agree; else None."""
    if len(offsets) < FLEET_AT_LEAST or 2 * len(offsets) <= known:
        return None
    median = statistics.median(offsets.values())
    agreeing = sorted(w for w, o in offsets.items() if abs(o - median) <= tolerance_s * AGREE_FRACTION)
    if len(agreeing) < FLEET_AT_LEAST or 2 * len(agreeing) <= known:
        return None
    return Fleet(statistics.median(offsets[w] for w in agreeing), agreeing, known)


def _stands(offsets: dict[str, float], known: int) -> bool:
    """Whether a fleet verdict stands though no fleet is judged off now: no worker's offset is
    known, or some are off and fewer than FLEET_AT_LEAST known clocks agree with this router's."""
    return known == 0 or (bool(offsets) and known - len(offsets) < FLEET_AT_LEAST)


def _moved(was: Fleet | None, now: Fleet | None, tolerance_s: float) -> bool:
    """Whether the fleet's verdict changed in substance: judged off or no longer, off by another
    offset, or mostly other workers agreeing."""
    if was is None or now is None:
        return (was is None) != (now is None)
    if abs(now.offset_s - was.offset_s) > tolerance_s * AGREE_FRACTION:
        return True
    if not was.agreeing:  # a verdict that stood over no worker (_stands): its offset is its substance
        return False
    return 2 * len(set(now.agreeing).intersection(was.agreeing)) < len(now.agreeing)
