"""A load report's floats: one inf or NaN (or a negative figure that cannot be) is refused like a
negative count, counted as malformed. Before, only the counts were checked, and one report with
decode_context or engine_ts inf left that worker's timing fit NaN for good (router.calibration)."""

from __future__ import annotations

import logging
import math
import time

import pytest
from nats.aio.client import Client

from protocol import LoadReport, encode_msg, subjects
from protocol.messages import load_report_problem
from runtime.nats_flush import flush
from tests.router.conftest import Cluster
from tests.router.polling import until

FLOATS = ("ts", "engine_ts", "period_s", "kv_usage", "prefill_seconds", "itl_seconds", "decode_context")


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", FLOATS)
def test_a_float_not_finite_is_refused_naming_it(name: str, value: float) -> None:
    fields: dict[str, float] = {"ts": 1e9, name: value}
    problem = load_report_problem(LoadReport(worker="w", **fields))  # type: ignore[arg-type]
    assert problem is not None and problem.startswith(f"{name} ") and "not a finite number" in problem


@pytest.mark.parametrize("name", [n for n in FLOATS if n != "ts"])
def test_a_negative_float_is_refused_but_a_clock_before_1970_is_only_a_clock(name: str) -> None:
    problem = load_report_problem(LoadReport(worker="w", ts=1e9, **{name: -0.5}))  # type: ignore[arg-type]
    assert problem == f"{name} -0.5 is negative"
    assert load_report_problem(LoadReport(worker="w", ts=-5.0)) is None


@pytest.mark.parametrize("name", ["kv_blocks", "kv_seq"])
def test_a_negative_digest_count_is_refused(name: str) -> None:
    """Before: a negative kv_blocks made the router's first-chunk wait negative (router.gap_repair),
    so every kvstate request of that worker failed at once."""
    assert load_report_problem(LoadReport(worker="w", ts=1e9, **{name: -5})) == f"{name} -5 is negative"  # type: ignore[arg-type]


def test_what_a_shim_sends_passes() -> None:
    honest = LoadReport(
        worker="w", ts=time.time(), engine_ts=time.time() - 0.1, period_s=0.5, kv_usage=0.25, prefill_seconds=12.5,
        itl_seconds=3.0, decode_context=4200.5,
    )  # fmt: skip
    assert load_report_problem(honest) is None
    assert load_report_problem(LoadReport(worker="w", ts=0.0)) is None  # every default, kv_usage None


async def test_a_report_with_an_inf_figure_is_dropped_counted_and_named(
    cluster: Cluster, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    w = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    caplog.set_level(logging.WARNING, logger="router.service")
    before = router.load_malformed
    for name in ("decode_context", "engine_ts"):
        report = LoadReport(worker=w.id, ts=time.time(), running=7, **{name: math.inf})  # type: ignore[arg-type]
        await nc.publish(subjects.load(cluster.ns, w.id), encode_msg(report))
    await flush(nc)
    await until(lambda: router.load_malformed == before + 2, what="both reports dropped")
    assert router.view.load(w.id).running != 7
    said = [r.getMessage() for r in caplog.records if "malformed load report" in r.getMessage()]
    assert len(said) == 1 and w.id in said[0] and "decode_context inf is not a finite number" in said[0]
