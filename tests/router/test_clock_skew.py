"""A worker whose clock disagrees with the router's is named, by the offset its load reports show."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import nats
import pytest

from protocol import LoadReport, encode_msg, subjects
from router.clock_skew import AGREE_FRACTION, WINDOW, ClockSkew
from tests.router.conftest import Cluster
from tests.router.polling import until


def test_one_report_stamped_ahead_proves_the_clock_ahead() -> None:
    clocks = ClockSkew(1.0)
    assert clocks.observe("w", 100.0, 100.3) is None  # 0.3 s in transit
    skew = clocks.observe("w", 105.0, 100.4)
    assert skew is not None and skew.skewed and skew.offset_s == pytest.approx(4.6)
    assert clocks.offsets() == {"w": pytest.approx(4.6)}
    assert clocks.offset("w") == pytest.approx(4.6) and clocks.offset("other") == 0.0
    assert clocks.observe("w", 106.0, 101.4) is None  # still ahead: said once


def test_a_clock_is_behind_only_when_a_whole_window_of_reports_is() -> None:
    clocks = ClockSkew(1.0)
    assert clocks.observe("w", 100.0, 102.5) is None  # one late report may just have been delayed
    assert clocks.observe("w", 101.0, 101.2) is None
    for i in range(WINDOW - 1):
        assert clocks.observe("w", 90.0 + i, 102.0 + i) is None
    skew = clocks.observe("w", 92.0, 104.0)
    assert skew is not None and skew.skewed and skew.offset_s == pytest.approx(-12.0)


def test_the_clock_back_in_agreement_is_said_and_the_worker_leaves_the_offsets() -> None:
    clocks = ClockSkew(1.0)
    assert clocks.observe("w", 130.0, 100.0) is not None
    for i in range(WINDOW - 1):
        assert clocks.observe("w", 101.0 + i, 101.0 + i) is None  # the ahead reading still in the window
    back = clocks.observe("w", 110.0, 110.0)
    assert back is not None and not back.skewed
    assert clocks.offsets() == {} and clocks.offset("w") == 0.0  # deadlines go out unmoved again


def test_a_clock_at_the_tolerance_is_not_said_on_every_jitter() -> None:
    # offset 1.003 s, transit 1-8 ms: off and back in turn, 239 log lines in 10 minutes
    clocks = ClockSkew(1.0)
    rng = random.Random(0)
    said = [
        skew
        for i in range(1200)
        if (skew := clocks.observe("w", 100.0 + i / 2 + 1.003, 100.0 + i / 2 + rng.uniform(0.001, 0.008)))
    ]
    assert [s.skewed for s in said] == [True]
    # it agrees again once well within the tolerance
    for i in range(WINDOW):
        back = clocks.observe("w", 800.0 + i + AGREE_FRACTION - 0.01, 800.0 + i)
    assert back is not None and not back.skewed


def test_reports_sent_in_a_burst_after_an_outage_say_nothing_of_the_clock() -> None:
    """A shim older than 2026-12-06 kept its reports in nats-py's reconnect buffer through a 6 s NATS
    outage and sent them in one burst once back: three in a row stamped seconds before they came
    judged its clock behind (a false WARNING for every worker, and its deadlines moved)."""
    clocks = ClockSkew(1.0)
    said = [clocks.observe("w", 100.0 + i / 2, 100.001 + i / 2) for i in range(20)]  # live, every 0.5 s
    burst = [clocks.observe("w", 110.0 + i / 2, 116.0 + i / 1000) for i in range(12)]  # 110-115.5, at 116
    said += burst + [clocks.observe("w", 116.0 + i / 2, 116.001 + i / 2) for i in range(1, 10)]
    assert [s for s in said if s is not None] == [] and clocks.offsets() == {}
    # A clock truly behind still is, its reports spaced as they were sent
    behind = [clocks.observe("w", 120.0 + i / 2 - 5.0, 120.001 + i / 2) for i in range(WINDOW)]
    assert behind[-1] is not None and behind[-1].skewed and behind[-1].offset_s == pytest.approx(-5.001)


def test_a_broken_stamp_and_a_gone_worker_are_forgotten() -> None:
    clocks = ClockSkew(1.0)
    assert clocks.observe("w", float("nan"), 100.0) is None
    assert clocks.observe("w", float("inf"), 100.0) is None
    assert clocks.observe("w", 200.0, 100.0) is not None
    clocks.remove("w")
    assert clocks.offsets() == {}


async def test_a_worker_reporting_from_a_clock_ahead_is_named_in_a_warning_and_the_metrics(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    caplog.set_level(logging.INFO, logger="router.service")
    nc = await nats.connect(cluster.nats_url)
    try:
        # As the worker's shim would report with its host clock 700 s ahead.
        forged = LoadReport(worker=worker.id, ts=time.time() + 700.0)
        await nc.publish(subjects.load(cluster.ns, worker.id), encode_msg(forged))
        line = f'kvswitch_router_worker_clock_offset_seconds{{worker="{worker.id}"}}'
        await until(lambda: line in router.metrics.render().decode(), what="the offset in /metrics")
    finally:
        await nc.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and worker.id in r.getMessage()]
    assert len(warned) == 1 and "ahead of this router's" in warned[0]
    assert "deadlines this router sends it are moved" in warned[0]
    # The shim's own reports, stamped by a clock that agrees, bring it back.
    await until(lambda: line not in router.metrics.render().decode(), timeout=10, what="the offset gone")
    assert any("agrees with this router's again" in r.getMessage() for r in caplog.records)


async def test_a_worker_whose_clock_steps_back_is_named_once_in_a_warning(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, its reports were dropped as reordered until its clock passed the last stamp: it read
    as silent (out of routing) for the whole step, and the log said nothing of it."""
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    caplog.set_level(logging.INFO, logger="router.service")
    subject = subjects.load(cluster.ns, worker.id)
    await until(lambda: router.view.liveness(worker.id) is not None, what="the shim's own report")
    nc = await nats.connect(cluster.nats_url)
    try:
        # As the worker's shim would report once its host clock stepped back a minute (NTP step).
        for _ in range(3):
            await nc.publish(subject, encode_msg(LoadReport(worker=worker.id, ts=time.time() - 60.0, period_s=0.5)))
            await asyncio.sleep(0.1)
        before = router.load_malformed  # a report dropped behind them: the router has read them all
        await nc.publish(subject, encode_msg(LoadReport(worker=worker.id, ts=time.time(), running=-1)))
        await until(lambda: router.load_malformed > before, what="the reports read")
    finally:
        await nc.close()
    stepped = [r for r in caplog.records if "clock stepped back" in r.getMessage()]
    assert len(stepped) == 1 and stepped[0].levelno == logging.WARNING and worker.id in stepped[0].getMessage()
