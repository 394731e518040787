"""A SIGTERM during a router's start: runtime.start_or_stop cancels the start, whose cleanup stops
the router (RouterService.start's `except BaseException: await self.stop()`), and cancels it again
every CANCEL_AGAIN_S while it runs on. A part's stop within that stop waiting on a task that lost its
cancellation (the workers' etcd watch) was cut off there, and what came after it never ran: the
registry's held record lines, and the lease's revoke: the router's key and its bookings stayed in
etcd to the lease's TTL (a review of 2026-12-07)."""

from __future__ import annotations

import asyncio
import logging

import pytest

import runtime
from discovery import Discovery
from protocol import subjects
from protocol.config import EtcdSettings, NatsSettings
from router.service import RouterConfig, RouterService
from router.worker_registry import WorkerRegistry
from runtime import start_or_stop
from tests.lost_cancellation import ends_within, never_answers


async def test_a_stop_during_start_revokes_the_lease_though_the_workers_watch_lost_its_cancellation(
    nats_url: str, etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.3)  # 10 s in service
    lost: list[str] = []
    watching = asyncio.Event()

    async def watch(self: WorkerRegistry) -> None:  # an etcd watch whose call drops one cancellation
        watching.set()
        while True:
            await never_answers(lost, "watch")

    real_start = WorkerRegistry.start
    flushed: list[bool] = []

    async def start(self: WorkerRegistry) -> None:
        await real_start(self)
        monkeypatch.setattr(self._records, "flush", lambda: flushed.append(True))  # what its stop says last
        await asyncio.Event().wait()  # a start step after it that does not answer (etcd, NATS)

    monkeypatch.setattr(WorkerRegistry, "_watch", watch)
    monkeypatch.setattr(WorkerRegistry, "start", start)
    etcd = EtcdSettings(endpoints=[etcd_url])
    router = RouterService(RouterConfig(ns=ns, nats=NatsSettings(servers=[nats_url]), etcd=etcd, lease_ttl_s=30))
    stop = asyncio.Event()
    started: list[bool] = []

    async def starting() -> None:
        started.append(await start_or_stop(router.start(), stop))

    async def sigterm() -> None:
        await watching.wait()
        stop.set()

    signal = asyncio.create_task(sigterm())
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert await ends_within(starting(), 10), "start_or_stop still waits on the start"
    await signal
    assert started == [False] and lost == ["watch"]
    assert router.router_id, "the router never registered"
    assert flushed == [True], "the workers' records held for their window's end were never said"
    async with Discovery(etcd, ns) as d:
        assert await d.holder(subjects.router_key(ns, router.router_id)) is None, "its lease was kept"
    said = [r.getMessage() for r in caplog.records if r.name == "runtime"]
    assert said == [
        "task worker-registry ran on through its cancellation (lost below it): cancelled again 1 time(s) before it "
        "ended"
    ], said


async def test_a_stop_during_start_cut_before_the_revoke_says_no_warning_of_it(
    nats_url: str, etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The registration's stop cut while its supervisor ends (a call below it lost its cancellation)
    revokes the lease still, then raises the cut: RouterService.stop took that for a revoke cut
    short and warned that peers may keep its bookings to its TTL, its lease gone (a review of
    2026-12-07). It reads how the revoke went, and says nothing of it."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.3)  # 10 s in service
    lost: list[str] = []
    ready = asyncio.Event()
    real_start = WorkerRegistry.start

    async def start(self: WorkerRegistry) -> None:
        await real_start(self)
        ready.set()
        await asyncio.Event().wait()  # a start step after it that does not answer (etcd, NATS)

    monkeypatch.setattr(WorkerRegistry, "start", start)

    async def tick() -> bool:  # the registration supervisor's etcd call drops one cancellation
        await never_answers(lost, "tick")
        return True

    etcd = EtcdSettings(endpoints=[etcd_url])
    router = RouterService(RouterConfig(ns=ns, nats=NatsSettings(servers=[nats_url]), etcd=etcd, lease_ttl_s=30))
    stop = asyncio.Event()
    started: list[bool] = []

    async def starting() -> None:
        started.append(await start_or_stop(router.start(), stop))

    async def sigterm() -> None:
        await ready.wait()
        registration = router._registration
        assert registration is not None
        monkeypatch.setattr(registration, "_tick", tick)
        registration._wake.set()  # its next tick now
        await asyncio.sleep(0.1)
        stop.set()

    signal = asyncio.create_task(sigterm())
    with caplog.at_level(logging.INFO):
        assert await ends_within(starting(), 10), "start_or_stop still waits on the start"
    await signal
    assert started == [False] and lost == ["tick"]
    async with Discovery(etcd, ns) as d:
        assert await d.holder(subjects.router_key(ns, router.router_id)) is None, "its lease was kept"
    said = [r.getMessage() for r in caplog.records if r.name == "router.service" and r.levelno >= logging.WARNING]
    assert said == [], said
