"""The router's live config follower outlives an unexpected exception: it used to run once, so one
crash kept the live settings as they were until the router restarted."""

from __future__ import annotations

import logging

import pytest

from discovery import Discovery, put_config
from protocol.config import EtcdSettings, RouterSettings
from tests.router.conftest import Cluster
from tests.router.polling import until


async def test_the_config_follower_survives_a_crash(
    nats_url: str, etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = Cluster(ns, nats_url, etcd_url)
    try:
        router = await cluster.add_router()
        configure = router.planner.configure
        calls = 0

        def crashes_once(settings: RouterSettings) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in applying settings")
            configure(settings)

        monkeypatch.setattr(router.planner, "configure", crashes_once)
        async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            with caplog.at_level(logging.ERROR):
                await put_config(d, {"eff_isl_threshold": 1111})
                # Watching again re-reads the value and applies it.
                await until(lambda: router.settings.conditional.eff_isl_threshold == 1111, what="applied")
            assert any("the live config watch crashed" in r.getMessage() for r in caplog.records)
            await put_config(d, {"eff_isl_threshold": 2222})
            await until(lambda: router.settings.conditional.eff_isl_threshold == 2222, what="a later change")
    finally:
        await cluster.close()
