"""A router's own start and stop, where its parts are not yet all there or one fails to stop."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from protocol import LoadReport, encode_msg, subjects
from router.service import RouterConfig, RouterService


def _report(ns: str, worker: str) -> SimpleNamespace:
    """A load report as nats-py hands it to RouterService._on_load."""
    report = LoadReport(worker=worker, ts=time.time(), period_s=0.5)
    return SimpleNamespace(subject=subjects.load(ns, worker), data=encode_msg(report), reply="")


async def test_load_reports_read_before_the_registry_starts_are_not_counted_as_from_unknown_workers() -> None:
    """The load subscription starts some awaits before the registry: each report read between was
    counted in kvswitch_router_load_unknown_total, as from a worker with no usable record, at every
    router start, for workers that have records (module read of 2026-12-07)."""
    router = RouterService(RouterConfig())
    for _ in range(3):
        await router._on_load(_report(router.ns, "w1"))  # type: ignore[arg-type]
    assert router.load_unknown == 0
    # started, its first read of etcd not yet in: every worker still reads as unknown (review)
    router._registry = SimpleNamespace(get=lambda worker: None)  # type: ignore[assignment]
    await router._on_load(_report(router.ns, "w1"))  # type: ignore[arg-type]
    assert router.load_unknown == 0
    # a worker with a record is read as soon as the registry has it, before the router marks it read
    # (a review of 63b57af found those reports dropped): the load view holds its report
    records = {"w1": SimpleNamespace(role="prefill")}
    router._registry = SimpleNamespace(get=records.get)  # type: ignore[assignment]
    heard: list[str] = []
    router.view.update = lambda report, *args, **kwargs: heard.append(report.worker)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="not started"):  # read on, past the view, to parts a start makes
        await router._on_load(_report(router.ns, "w1"))  # type: ignore[arg-type]
    assert heard == ["w1"]
    router._registry = SimpleNamespace(get=lambda worker: None)  # type: ignore[assignment]
    router._registry_ready = True  # read: a worker with no record now is one
    await router._on_load(_report(router.ns, "w1"))  # type: ignore[arg-type]
    assert router.load_unknown == 1


class _Failing:
    async def stop(self) -> None:
        raise RuntimeError("a bug in its stop")


async def test_a_part_whose_stop_fails_is_said_with_its_traceback_and_the_stop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It was swallowed without a word (contextlib.suppress), whatever that part still held."""
    caplog.set_level(logging.ERROR, logger="router.service")
    router = RouterService(RouterConfig())
    router._dispatcher = _Failing()  # type: ignore[assignment]
    await router.stop()
    [record] = [r for r in caplog.records if r.name == "router.service"]
    assert record.getMessage() == "stopping the router's _Failing failed"
    assert record.exc_info is not None and str(record.exc_info[1]) == "a bug in its stop"
    assert router.status.name == "STOPPED"
