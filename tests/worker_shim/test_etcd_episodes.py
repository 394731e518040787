"""What a shim says of etcd failing it (worker_shim.etcd_episodes), against a real etcd behind a
relay that refuses or freezes this shim's connections while etcd serves everyone else.

Audit of 2026-12-07: registering with etcd down was a WARNING every try (about 3,000 lines an hour
per shim) naming no flag and no end, each try a whole new session that asked the engine for a full
replay; a shim cut off from a live etcd past its lease TTL said "serving" and nothing else."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from discovery import DiscoveryError
from engine_sim.server import SimServer
from kvswitch.servers import EtcdServer
from tests.relay import Relay
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_http_server import health, scrape
from worker_shim.adapters import EngineHealth
from worker_shim.etcd_episodes import SAID_EVERY_S, RegisterFailures

UNRENEWED = ("kvswitch_shim_lease_unrenewed_seconds", ())


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def test_a_registration_failing_is_said_once_then_counted_every_30_s_then_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    clock = _Clock()
    failures = RegisterFailures(1.2, clock)
    for _ in range(25):  # 25 tries, 1.2 s apart: 28.8 s
        failures.failed(DiscoveryError("lease grant failed: UNAVAILABLE"))
        clock.now += 1.2
    [first] = [r.getMessage() for r in caplog.records]
    assert first.startswith("registering with etcd failed (lease grant failed: UNAVAILABLE): retrying every 1.2s")
    assert "--etcd-endpoints" in first
    assert failures.trouble() == "registering with etcd fails for 30 s (25 tries): lease grant failed: UNAVAILABLE"
    failures.failed(DiscoveryError("lease grant failed: UNAVAILABLE"))  # 30 s after the first
    assert caplog.records[-1].getMessage() == (
        "registering with etcd still fails after 30s (26 tries; the last: lease grant failed: UNAVAILABLE; check "
        "--etcd-endpoints and the server)"
    )
    clock.now += SAID_EVERY_S / 2
    failures.registered()
    assert caplog.records[-1].getMessage() == "registered after 45.0s of etcd failing (26 tries)"
    assert len(caplog.records) == 3 and failures.trouble() == ""
    failures.registered()  # no episode: nothing to say
    failures.failed(DiscoveryError("again"))  # a new episode is said at once
    assert len(caplog.records) == 4 and caplog.records[-1].getMessage().startswith("registering with etcd failed")


@pytest.fixture
async def relay(etcd_server: EtcdServer) -> AsyncIterator[Relay]:
    relay = Relay(etcd_server.port)
    await relay.start()
    yield relay
    relay.cut()
    await relay.close()


async def test_registering_with_etcd_down_retries_within_the_session_saying_it_once(
    relay: Relay, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, f"http://127.0.0.1:{relay.port}")
        async with shim:
            # start() connected to etcd; its session has not run yet: every registration meets etcd gone
            relay.accepting = False
            relay.cut()
            checks = 0  # of the engine's health: one a try, whether a session starts or goes on
            checked = shim.adapter.health

            async def counted() -> EngineHealth:
                nonlocal checks
                checks += 1
                return await checked()

            shim.adapter.health = counted  # type: ignore[method-assign]
            await wait_for(lambda: checks >= 8, what="8 tries")
            status, body = await health(shim.http.url)
            relay.accepting = True
            await wait_for(shim.registered.is_set, what="registered once etcd is back")
    warned = [r for r in caplog.records if r.name == "worker_shim.shim" and r.levelno >= logging.WARNING]
    assert not any("registration failed" in r.getMessage() for r in warned), "the old line, once per try"
    [said] = _said(caplog, "registering with etcd failed")
    assert "--etcd-endpoints" in said.getMessage()
    assert len(_said(caplog, "registered after")) == 1
    # One session: the engine was not asked for its limits, tokenizer and whole state again at each try.
    assert shim.sessions == 1
    assert status == 503 and str(body["etcd_why"]).startswith("registering with etcd fails for"), body


async def test_a_shim_cut_off_from_a_live_etcd_past_its_ttl_says_its_key_is_gone_and_serves_on(
    relay: Relay, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        SimServer(sim_config()) as sim,
        shim_for(sim, ns, nats_url, f"http://127.0.0.1:{relay.port}", lease_ttl=2) as shim,
    ):
        await wait_for(shim.registered.is_set, what="registered")
        first = shim.worker_id
        relay.frozen.set()  # etcd serves everyone else: the key goes with the lease's TTL
        warning = "etcd has not renewed this worker's lease"
        await wait_for(lambda: bool(_said(caplog, warning)), 15, "the warning")
        status, body = await health(shim.http.url)
        # still 200 "serving": it serves what it is sent (a router cut off too, the legs in flight)
        assert status == 200 and body["status"] == "serving", body
        assert str(body["etcd_why"]).startswith(warning) and "its key is gone" in str(body["etcd_why"]), body
        unrenewed = body["lease_unrenewed_s"]
        assert isinstance(unrenewed, float) and unrenewed >= 2, body  # past 2 s, rounded to 0.1
        assert (await scrape(shim.http.url))[UNRENEWED] > 2
        await wait_for(lambda: shim.lease_unrenewed_s is not None and shim.lease_unrenewed_s > 4, 15, "4 s")
        [said] = _said(caplog, warning)  # once per episode, not once per check
        assert said.levelno == logging.WARNING and "(TTL 2 s)" in said.getMessage()
        relay.frozen.clear()
        relay.cut()  # the frozen connections go; new ones are relayed
        await wait_for(lambda: bool(_said(caplog, "etcd answers this worker again")), 20, "the end")
        [back] = _said(caplog, "etcd answers this worker again")
        assert back.getMessage().endswith(f"was gone, registered anew as {shim.worker_id}")
        assert shim.worker_id != first
        status, body = await health(shim.http.url)
        assert status == 200 and body["etcd_why"] == "" and body["lease_unrenewed_s"] is None, body
        assert (await scrape(shim.http.url))[UNRENEWED] == 0
