"""Each model's decode and agg workers taking requests, and left out by reason, are gauges an alert
can read (kvswitch_router_workers_routable, kvswitch_router_workers_excluded), fed from the
fleet check's last figures (router.fleet_news): on a router of several models /ready stays 200
while one of them has no worker taking requests, and until 2026-12-06 only a WARNING said so."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.eligibility import Exclusion, WorkerStatus
from router.fleet_news import DEPARTED_AT_MOST, FleetNews
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster

OTHER = "sim-other"


def _status(worker: str, model: str, exclusion: Exclusion | None, role: str = "decode") -> WorkerStatus:
    return WorkerStatus(worker, model, role, exclusion, "", True)


def test_the_figures_are_the_last_checks_and_a_reason_or_model_gone_is_gone() -> None:
    news = FleetNews()
    news.check([_status("a", "m", None), _status("b", "m", Exclusion.SILENT), _status("p", "m", None, "prefill")], 1.0)
    assert news.routable == {"m": 1} and news.excluded == {"m": {Exclusion.SILENT: 1}}
    news.check([_status("a", "m", None), _status("b", "m", None), _status("c", "n", Exclusion.DRAINING)], 2.0)
    assert news.routable == {"m": 2, "n": 0} and news.excluded == {"m": {}, "n": {Exclusion.DRAINING: 1}}
    # Its workers left: 0 while followed (a crash's leases expire), no reason left to count
    news.check([_status("a", "m", None)], 3.0)
    assert news.routable == {"m": 1, "n": 0} and "n" not in news.excluded


def test_engine_unhealthy_workers_take_requests_only_while_none_is_routable() -> None:
    news = FleetNews()
    unhealthy = [_status(f"u{i}", "m", Exclusion.ENGINE_UNHEALTHY) for i in range(3)]
    news.check([_status("a", "m", None), *unhealthy], 1.0)
    assert news.routable == {"m": 1} and news.excluded == {"m": {Exclusion.ENGINE_UNHEALTHY: 3}}
    news.check(unhealthy, 2.0)
    assert news.routable == {"m": 3}


def test_departed_models_are_figures_only_while_followed() -> None:
    news = FleetNews()
    models = [f"m{i:03d}" for i in range(DEPARTED_AT_MOST + 2)]
    for t, model in enumerate(models):
        news.check([_status("w", model, None)], float(t))
    assert news.routable == {models[-1]: 1, **dict.fromkeys(models[-1 - DEPARTED_AT_MOST : -1], 0)}


async def _gauges(http: aiohttp.ClientSession, router: RouterService) -> tuple[dict[str, float], dict[str, float]]:
    """kvswitch_router_workers_routable by model, kvswitch_router_workers_excluded by (model, reason)."""
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    routable, excluded = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvswitch_router_workers_routable":
                routable[s.labels["model"]] = s.value
            elif s.name == "kvswitch_router_workers_excluded":
                excluded[f"{s.labels['model']}/{s.labels['reason']}"] = s.value
    return routable, excluded


async def test_a_model_whose_workers_stop_reporting_reads_0_and_silent_while_ready_stays_200(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    quiet = [await cluster.add_worker("decode") for _ in range(2)]
    await cluster.add_worker("agg", model=OTHER)
    router = await cluster.add_ready_router()
    assert set(router.models()) == {MODEL, OTHER}
    healthy: tuple[dict[str, float], dict[str, float]] = ({MODEL: 2.0, OTHER: 1.0}, {})
    await _gauges_until(http, router, healthy, "every worker taking requests")
    reporters = [w.shim.load_reporter for w in quiet]
    for reporter in reporters:
        assert reporter is not None
        await reporter.stop()
    await _gauges_until(http, router, ({MODEL: 0.0, OTHER: 1.0}, {f"{MODEL}/silent": 2.0}), f"{MODEL} out as silent")
    async with http.get(router.url + "/ready") as r:
        assert r.status == 200, await r.text()  # the other model takes requests
    for reporter in reporters:
        assert reporter is not None
        reporter.start()
    await _gauges_until(http, router, healthy, "the silent series gone")


async def _gauges_until(
    http: aiohttp.ClientSession, router: RouterService, want: tuple[dict[str, float], dict[str, float]], what: str
) -> None:
    """Scrape until the gauges read `want`; fail with the last scrape after 15 s."""
    seen = await _gauges(http, router)
    try:
        async with asyncio.timeout(15):
            while seen != want:
                await asyncio.sleep(0.05)
                seen = await _gauges(http, router)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}: last scrape {seen}, want {want}") from None


async def test_a_fleet_check_that_raises_is_logged_and_runs_again(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, one exception ended the check's task for good: its gauges froze at their last values.
    calls = {"n": 0}

    def check_once_broken(statuses: list[WorkerStatus], now: float, period_s: float, **kw: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a broken check")
        real(statuses, now, period_s, **kw)

    await cluster.add_worker("decode")
    router = await cluster.add_router()
    real = router.fleet_news.check
    monkeypatch.setattr(router.fleet_news, "check", check_once_broken)
    await cluster.ready(router)
    await _gauges_until(http, router, ({MODEL: 1.0}, {}), "the check running again")
    assert calls["n"] >= 2
    assert any("fleet check" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
