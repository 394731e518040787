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

A report stamped behind that arrives less than half as long after the worker's last one as it was
stamped after it waited in a queue on the way: a shim's NATS reconnect buffer sent in one burst once
NATS is back (a shim older than 2026-12-06 kept its reports there through an outage), this
router's loop stalled with reports in its socket. Its offset is that wait, not the clock, and it
is not read (the first of such a burst is, one reading of the WINDOW): after any outage over
WINDOW periods such bursts judged every worker's clock behind by the outage's length.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["AGREE_FRACTION", "WINDOW", "ClockSkew", "Skew"]

WINDOW = 3
AGREE_FRACTION = 0.5


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

    def observe(self, worker: str, stamped: float, received: float) -> Skew | None:
        """One report's stamp and its receipt on our clock; a Skew when the worker's state changed."""
        if not math.isfinite(stamped):  # a broken stamp says nothing of the clock
            return None
        r = self._workers.get(worker)
        if r is None:
            r = self._workers[worker] = _Readings()
        last, r.last = r.last, (stamped, received)
        if last is not None and stamped < received and 0 <= received - last[1] < (stamped - last[0]) / 2:
            return None  # it waited in a queue on the way (module docstring)
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

    def remove(self, worker: str) -> None:
        self._workers.pop(worker, None)
