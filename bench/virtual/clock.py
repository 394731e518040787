"""The virtual clock: a discrete-event loop with no sockets, no sleeps and no wall time.

Callbacks run in order of their virtual time; callbacks due at the same instant run in the order
they were scheduled, so a run is a pure function of its inputs. `time()` is the clock every part
of the simulated fleet is given (engines, shims, the routers' load views, pending prefixes and
eligibility), so they all read one time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["VirtualClock", "last_round"]


class VirtualClock:
    __slots__ = ("_heap", "_seq", "events", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        return self.now

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at virtual time `when` (now, if `when` is in the past)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self) -> None:
        """Run callbacks until none is left."""
        heap, pop = self._heap, heapq.heappop
        while heap:
            when, _, fn, args = pop(heap)
            self.now = when
            self.events += 1
            fn(*args)


def last_round(start: float, steps: Sequence[float], until: float) -> float:
    """Where a loop that adds `steps` (each >= 0) to its time in turn, as repeated `after` calls
    do, stands after its last whole round from `start` ending at or before `until` (`start` if the
    first ends later): the very float the additions reach, in a few rounds per binade.

    Why a jump is exact: within one binade every time is a whole number of ulps and each addition
    adds a fixed number of them, but for a tie, which rounds to even whatever the time was; so a
    round's end parity does not depend on its start, and from the second round on each round adds
    the same number of ulps."""

    def round_(t: float) -> float:
        for step in steps:
            t += step
        return t

    t = start
    while t < (t1 := round_(t)) <= until:
        t2 = round_(t1)
        end = min(until, math.ldexp(1.0, math.frexp(t)[1]))  # t's binade ends at 2**e
        if t > 0 and t1 < t2 < end:  # t1 == t2: the additions stopped moving it
            period = t2 - t1  # exact: both in t's binade
            rounds = math.floor((end - t1) / period) - 2  # two spare for the division's rounding
            t = t1 + rounds * period if rounds > 0 else t1
        else:
            t = t1
    return t
