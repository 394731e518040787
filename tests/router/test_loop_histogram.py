"""router.loop_histogram.LoopHistogram exposes what prometheus_client's Histogram does."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client import metrics as client_metrics

from router.loop_histogram import LoopHistogram
from router.metrics import RouterMetrics, StateFigures

_disable_created = cast(Callable[[], None], disable_created_metrics)  # untyped

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


def test_it_leaves_created_out_where_prometheus_client_does() -> None:
    was = client_metrics._use_created  # a module global: restored for the tests after this one
    try:
        _disable_created()
        mine, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
        LoopHistogram("x_seconds", "what it is", _BUCKETS, mine).observe(0.02)
        Histogram("x_seconds", "what it is", buckets=_BUCKETS, registry=theirs).observe(0.02)
        assert _text(mine) == _text(theirs)
        assert not any("_created" in line for line in _text(mine))
    finally:
        client_metrics._use_created = was


def test_a_registry_refuses_a_second_collector_of_its_name() -> None:
    registry = CollectorRegistry(auto_describe=False)
    LoopHistogram("x_seconds", "what it is", _BUCKETS, registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("x_seconds", "what it is", buckets=_BUCKETS, registry=registry)
    other = CollectorRegistry(auto_describe=False)
    Histogram("y_seconds", "what it is", buckets=_BUCKETS, registry=other)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopHistogram("y_seconds", "what it is", _BUCKETS, other)


def test_the_routers_registry_refuses_a_second_itl_histogram() -> None:
    metrics = RouterMetrics(StateFigures)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("kvswitch_router_itl_seconds", "again", registry=metrics.registry)
