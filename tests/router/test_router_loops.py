"""The router's own loops and its registration fail loudly (docs/router.md, "The router's loops"):
a loop whose round can fail on its data (replica sync's flush and expiry) says an ERROR and goes
on; a loop the router needs that ends anyway (the loop watch, etcd's auth token, the worker watch)
and a failed registration each make /ready a 503 naming it, and the router stop (its drain, its
lease revoked) and exit with status 1 for its supervisor to restart it (RouterService.serve, as
`kvswitch router` runs it). Before 2026-12-06 each was one ERROR at most, /ready stayed 200, and a
lease the stop could not revoke was not said; until that day's review, the 503 was all, and nothing
restarted the router (Kubernetes' liveness probe is /health). Real nats-server and etcd."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from nats.aio.client import Client

from discovery import Discovery, Registration
from discovery.lease import Lease
from protocol import subjects
from protocol.config import EtcdSettings
from router import RouterStatus
from router.load_view import Expired, LoadView
from router.replica_sync import ReplicaSync
from runtime.loop_watch import LoopWatch
from runtime.nats_flush import flush
from tests.router.conftest import Cluster
from tests.router.polling import until


async def _ready(http: aiohttp.ClientSession, url: str) -> tuple[int, list[str]]:
    async with http.get(url + "/ready") as r:
        return r.status, (await r.json())["problems"]


def _router_supervisor_ends(monkeypatch: pytest.MonkeyPatch, ns: str) -> asyncio.Event:
    """The router's registration supervisor (not a worker's) ends as it starts; the event is set then."""
    real = Registration._supervise
    ended = asyncio.Event()

    async def supervise(self: Registration) -> None:
        if self.key.startswith(subjects.routers_prefix(ns)):
            ended.set()
            raise RuntimeError("injected: the router's registration supervisor ended")
        await real(self)

    monkeypatch.setattr(Registration, "_supervise", supervise)
    return ended


async def _router_key_held(cluster: Cluster, router_id: str) -> bool:
    async with Discovery(EtcdSettings(endpoints=[cluster.etcd_url]), cluster.ns) as d:
        return await d.holder(subjects.router_key(cluster.ns, router_id)) is not None


async def test_a_failed_registration_makes_ready_503_and_the_router_exit_1(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.add_worker("agg")
    ended = _router_supervisor_ends(monkeypatch, cluster.ns)
    caplog.set_level(logging.INFO)
    router = await cluster.add_router()
    await ended.wait()
    await until(lambda: router._registration is not None and router._registration.failed.is_set(), what="failed")
    status, problems = await _ready(http, router.url)
    assert status == 503
    assert any("registration in etcd failed" in p and "supervisor" in p and "status 1" in p for p in problems), problems
    await asyncio.wait_for(router.broken.wait(), 5)
    said = [r for r in caplog.records if "no longer correct" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in caplog.records]
    assert router.router_id in said[0].getMessage() and "registration in etcd failed" in said[0].getMessage()
    assert "exits with status 1" in said[0].getMessage()
    assert await _router_key_held(cluster, router.router_id)  # its lease lives on: peers still count its bookings
    assert await asyncio.wait_for(router.serve(asyncio.Event()), 20) == 1
    assert router.status is RouterStatus.STOPPED
    assert not await _router_key_held(cluster, router.router_id)  # stopped as on SIGTERM: its lease revoked


def _revoke_fails(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "etcd refuses":  # what etcd answers, through the real Lease.revoke and Registration.stop

        async def revoke(self: Lease, timeout: float) -> BaseException | None:
            return TimeoutError("injected: etcd does not answer the revoke")

        monkeypatch.setattr(Lease, "_revoke", revoke)
    else:
        real = Registration.stop

        async def stop(self: Registration) -> bool:
            await real(self)
            raise RuntimeError("injected: a bug in Registration.stop")

        monkeypatch.setattr(Registration, "stop", stop)


@pytest.mark.parametrize("how", ["etcd refuses", "a bug"])
async def test_a_lease_the_stop_cannot_revoke_is_an_error(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Lease.revoke said a failed revoke as a WARNING and returned as if it went (review of
    2026-12-06): the router's ERROR fired only on an injected raise."""
    router = await cluster.add_router()
    _revoke_fails(monkeypatch, how)
    caplog.set_level(logging.INFO)
    await router.stop()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "revoking router" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    said = errors[0].getMessage()
    assert router.router_id in said and "TTL (10 s)" in said and "bookings" in said and "legs" in said, said
    if how == "a bug":
        assert errors[0].exc_info is not None and "traceback" in said
    else:
        assert any(r.levelno == logging.WARNING and "revoke failed" in r.getMessage() for r in caplog.records)


async def test_a_loop_the_router_needs_that_crashes_makes_ready_503_and_the_router_exit_1(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    assert (await _ready(http, router.url))[0] == 200

    async def run(self: LoopWatch) -> None:
        raise RuntimeError("injected: a bug in the loop watch")

    monkeypatch.setattr(LoopWatch, "_run", run)
    caplog.set_level(logging.ERROR)
    await router.loop_watch.stop()
    router.loop_watch.start()  # the same watch, started again: its loop now crashes at once
    await until(lambda: router.loop_watch.task is not None and router.loop_watch.task.done(), what="the crash")
    status, problems = await _ready(http, router.url)
    assert status == 503
    assert any("task loop-watch crashed" in p and "RuntimeError" in p for p in problems), problems
    assert await asyncio.wait_for(router.serve(asyncio.Event()), 20) == 1  # as `kvswitch router` runs it
    assert router.status is RouterStatus.STOPPED
    said = [r.getMessage() for r in caplog.records if "no longer correct" in r.getMessage()]
    assert len(said) == 1 and "task loop-watch crashed" in said[0] and "status 1" in said[0], said


async def test_a_router_stopped_by_its_owner_exits_0(cluster: Cluster) -> None:
    """The control: `stop` set (a SIGTERM) is no failure."""
    router = await cluster.add_router()
    stop = asyncio.Event()
    serving = asyncio.create_task(router.serve(stop))
    await asyncio.sleep(0.1)
    assert not serving.done()
    stop.set()
    assert await asyncio.wait_for(serving, 20) == 0
    assert router.status is RouterStatus.STOPPED and not router.broken.is_set()
    assert not await _router_key_held(cluster, router.router_id)


async def test_a_sync_flush_that_raises_is_an_error_and_later_bookings_still_go(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ReplicaSync._send
    raised: list[bool] = []

    async def send_once_bad(self: ReplicaSync) -> None:
        if self.router_id == "ra" and not raised:
            raised.append(True)
            self._pending.clear()
            raise RuntimeError("injected: a bug in the flush")
        await real(self)

    monkeypatch.setattr(ReplicaSync, "_send", send_once_bad)
    a = ReplicaSync(nc, ns, "ra", LoadView(), flush_ms=1.0)
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    await a.start()
    await b.start()
    await flush(nc)
    try:
        with caplog.at_level(logging.ERROR, logger="router.replica_sync"):
            a.add("lost", "w1", 5, 1)
            await until(lambda: bool(raised), what="the flush that raises")
            a.add("req2", "w1", 7, 1)
            await until(lambda: b.view.bookings("w1") == 1, what="the later booking reaching the peer")
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None and "flush" in errors[0].getMessage()
        assert not any(t.done() for t in a.tasks)
    finally:
        await a.stop()
        await b.stop()


async def test_a_sync_expiry_that_raises_is_an_error_and_later_bookings_still_expire(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = LoadView.expire
    raised: list[bool] = []

    peer_view = LoadView()

    def expire_once_bad(self: LoadView, max_age_s: float, *, peers_only: bool = True) -> dict[str | None, Expired]:
        if self is peer_view and not raised:
            raised.append(True)
            raise RuntimeError("injected: a booking that breaks expire()")
        return real(self, max_age_s, peers_only=peers_only)

    monkeypatch.setattr(LoadView, "expire", expire_once_bad)
    a = ReplicaSync(nc, ns, "ra", LoadView(), flush_ms=1.0)
    b = ReplicaSync(nc, ns, "rb", peer_view, flush_ms=1.0, peer_ttl_s=0.2)
    await a.start()
    await b.start()
    await flush(nc)
    try:
        with caplog.at_level(logging.ERROR, logger="router.replica_sync"):
            await until(lambda: bool(raised), what="the expiry that raises")
            a.add("req1", "w1", 5, 1)
            await until(lambda: b.view.bookings("w1") == 1, what="the booking at the peer")
            await until(lambda: b.view.bookings("w1") == 0, what="the booking expired")
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None and "expiring" in errors[0].getMessage()
    finally:
        await a.stop()
        await b.stop()
