"""BucketCounts: a histogram's counts by bucket and its sum, kept as plain numbers by the one owner
that observes it (no lock). The engine sim's histograms and the router's ITL histogram share it;
each writes its own exposition (labels, `le` strings, `_created`) from `cumulative()` and `sum`."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["BucketCounts"]


class BucketCounts:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value`; an upper bound is inclusive, as Prometheus' `le` is."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        if times == 1:
            self.sum += value
            return
        # one addition per observation, as a Prometheus client sums them: `value * times` rounds
        # otherwise (0.1 ten times is 0.9999999999999999, 0.1 * 10 is 1.0)
        total = self.sum
        for _ in range(times):
            total += value
        self.sum = total

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) per bucket, the last bound +Inf."""
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out
