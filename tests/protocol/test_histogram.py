"""protocol.histogram.BucketCounts: counts by bucket, le inclusive, and a sum as a client adds it."""

from __future__ import annotations

import math

from protocol.histogram import BucketCounts


def test_an_observation_counts_in_the_first_bucket_whose_bound_holds_it() -> None:
    h = BucketCounts((1, 5))
    for value in (1, 0.5, 2, 5, 7):  # on a bound, below, between, on the last, past it
        h.observe(value)
    assert h.counts == [2, 2, 1] and h.count == 5
    assert h.cumulative() == [(1, 2), (5, 4), (math.inf, 5)]


def test_times_observations_add_to_the_sum_one_by_one() -> None:
    h, one_by_one = BucketCounts((1,)), BucketCounts((1,))
    h.observe(0.1, 10)
    for _ in range(10):
        one_by_one.observe(0.1)
    # 0.1 * 10 rounds to 1.0; ten additions of 0.1 do not
    assert (h.counts, h.sum) == (one_by_one.counts, one_by_one.sum) == ([10, 0], 0.9999999999999999)
