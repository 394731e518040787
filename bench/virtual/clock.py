"""The virtual clock: a discrete-event loop with no sockets, no sleeps and no wall time.

Callbacks run in order of their virtual time; callbacks due at the same instant run in the order
they were scheduled, so a run is a pure function of its inputs. `time()` is the clock every part
of the simulated fleet is given (engines, shims, the routers' load views, pending prefixes and
eligibility), so they all read one time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["VirtualClock"]


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
