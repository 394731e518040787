"""router.loop_histogram.LoopHistogram exposes what prometheus_client's Histogram does."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.loop_histogram import LoopHistogram

_BUCKETS = (0.001, 0.01, 0.025, 0.1, 2.5)


def _text(registry: CollectorRegistry) -> list[str]:
    # the _created timestamps differ: their names, not their values
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created " in line else line for line in lines]


def test_its_exposition_is_prometheus_clients_histogram() -> None:
    mine, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    loop = LoopHistogram("x_seconds", "what it is", _BUCKETS, mine)
    ref = Histogram("x_seconds", "what it is", buckets=_BUCKETS, registry=theirs)
    # on a bound (le is inclusive), between, below the first, past the last; 0.1 ten times is
    # 0.9999999999999999 added one by one as Histogram does, 1.0 multiplied
    for amount, times in ((0.001, 1), (0.01, 2), (0.02, 1), (0.0, 1), (3.0, 1), (0.1, 3), (0.1, 10)):
        loop.observe(amount, times)
        for _ in range(times):
            ref.observe(amount)
    assert _text(mine) == _text(theirs)
