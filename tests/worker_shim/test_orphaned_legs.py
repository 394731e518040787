"""The legs of a router that died without its drain are cancelled: OrphanedLegs at hand-made
watch events, then a real shim, etcd, NATS and sim, with the router's key revoked as its lease's
expiry would take it after a kill -9."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator
from typing import cast

import pytest

import runtime
from discovery import Deleted, Discovery, Put, Snapshot
from engine_sim.server import SimServer
from kvswitch.etcd_auth import PING_KEY, EtcdUser, enable_auth, namespace_users
from kvswitch.servers import EtcdServer
from protocol import RouterInfo, subjects
from protocol.config import EtcdSettings
from runtime import cancel_and_wait
from tests.lost_cancellation import never_answers
from tests.worker_shim.cluster import connect, shim_for, sim_config, wait_for
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim import WorkerShim
from worker_shim.orphaned_legs import OrphanedLegs


def _router(name: str, instance: str) -> RouterInfo:
    return RouterInfo(router=name, http_url="http://127.0.0.1:1", started_at=0.0, instance=instance)


class _Legs:
    def __init__(self, *origins: str) -> None:
        self.legs = list(origins)
        self.cancelled: list[str] = []

    def origins(self) -> set[str]:
        return set(self.legs)

    def cancel(self, origin: str) -> int:
        n = self.legs.count(origin)
        self.legs = [o for o in self.legs if o != origin]
        self.cancelled += [origin] * n
        return n


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _orphans(legs: _Legs, clock: _Clock, grace_s: float = 10.0) -> OrphanedLegs:
    return OrphanedLegs(legs.origins, legs.cancel, grace_s, clock)


def test_the_legs_of_an_instance_gone_for_the_grace_are_cancelled_once() -> None:
    legs, clock = _Legs("a", "a", "b"), _Clock()
    orphans = _orphans(legs, clock)
    orphans.update(Snapshot({"r1": _router("r1", "a"), "r2": _router("r2", "b")}, 1))
    orphans.check()
    orphans.update(Deleted("r1", 2))
    clock.now = 1.0
    orphans.check()  # gone since 1.0
    clock.now = 10.9
    orphans.check()
    assert legs.cancelled == []
    clock.now = 11.0
    orphans.check()
    assert legs.cancelled == ["a", "a"] and legs.legs == ["b"] and orphans.cancelled == 2
    clock.now = 30.0
    orphans.check()
    assert orphans.cancelled == 2  # once


def test_an_instance_registered_anew_under_another_key_keeps_its_legs() -> None:
    # a lost lease: the router registers again under a new id, the same process and instance
    legs, clock = _Legs("a"), _Clock()
    orphans = _orphans(legs, clock)
    orphans.update(Snapshot({"r1": _router("r1", "a")}, 1))
    orphans.update(Deleted("r1", 2))
    orphans.check()
    clock.now = 5.0
    orphans.update(Put("r9", _router("r9", "a"), 3))
    orphans.check()
    clock.now = 60.0
    orphans.check()
    assert legs.cancelled == [] and orphans.cancelled == 0


def test_an_instance_never_seen_registered_and_legs_without_one_are_never_judged() -> None:
    # a router that started while this watch was down, a client that names no router
    legs, clock = _Legs("unseen", ""), _Clock()
    orphans = _orphans(legs, clock)
    orphans.update(Snapshot({}, 1))
    for clock.now in (0.0, 100.0, 1000.0):
        orphans.check()
    assert legs.cancelled == []


def test_a_key_back_within_the_grace_restarts_it() -> None:
    legs, clock = _Legs("a"), _Clock()
    orphans = _orphans(legs, clock)
    orphans.update(Snapshot({"r1": _router("r1", "a")}, 1))
    orphans.update(Deleted("r1", 2))
    orphans.check()
    clock.now = 9.0
    orphans.update(Put("r1", _router("r1", "a"), 3))
    orphans.check()
    orphans.update(Deleted("r1", 4))
    clock.now = 10.0
    orphans.check()
    clock.now = 19.0
    orphans.check()
    assert legs.cancelled == []  # 9 s since it went again, not 19
    clock.now = 20.0
    orphans.check()
    assert legs.cancelled == ["a"]


async def test_a_router_whose_key_expires_has_its_legs_cancelled_in_the_engine(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with (
        SimServer(sim_config(speedup=5.0)) as sim,
        shim_for(sim, ns, nats_url, etcd_url, orphan_grace_s=0.5) as shim,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as routers,
    ):
        await shim.registered.wait()
        orphans = shim.orphans
        assert shim.worker_id is not None and orphans is not None
        dead = await routers.register_router(lambda rid: _router(rid, "dead0001"), ttl=30)
        alive = await routers.register_router(lambda rid: _router(rid, "alive001"), ttl=30)
        nc = await connect(nats_url)
        try:
            col = Collector(nc)
            await col.start()
            subject = subjects.gen(ns, "agg", shim.worker_id)
            legs: list[tuple[str, str]] = [("d1", "dead0001"), ("d2", "dead0001"), ("a1", "alive001"), ("n1", "")]
            for rid, origin in legs:
                await col.send(subject, gen(rid, list(range(1, 200)), max_tokens=5000, origin=origin))
            await wait_for(lambda: all(len(col.chunks[rid]) >= 2 for rid, _ in legs), what="all four streaming")
            await wait_for(lambda: "dead0001" in orphans.live(), what="the shim seeing the router")
            await routers.release(dead)  # as its lease's expiry does after a kill -9

            for rid in ("d1", "d2"):  # an error, not an abort: a router cut off from etcd reads it
                final = await col.final(rid)
                assert final.error is not None and (final.error.code, final.error.kind) == (503, "router_gone")
                assert "--orphan-grace-s" in final.error.message
            assert orphans.cancelled == 2
            await asyncio.sleep(1.5)  # more checks: the others run on
            assert "a1" not in col.finals and "n1" not in col.finals
            assert shim.requests is not None and set(shim.requests.inflight) == {"a1", "n1"}
            assert b"kvswitch_shim_legs_orphaned_total 2.0" in shim.metrics_text()
        finally:
            await routers.release(alive)
            await nc.close()


async def test_the_worker_role_reads_the_routers_and_a_role_without_it_is_told_apart() -> None:
    # the shim follows /{ns}/routers/ as the worker user; a cluster whose auth predates that grant
    # is said once at ERROR by the shim (Discovery.readable), not retried for good
    with EtcdServer() as server:
        old_worker = EtcdUser("old", "old-pw", readwrite=[subjects.workers_prefix("authns")], keys=[PING_KEY])
        enable_auth(server.url, "root-pw", [*namespace_users("authns", "router-pw", "worker-pw"), old_worker])
        prefix = subjects.routers_prefix("authns")
        for user, password, readable in (("worker", "worker-pw", True), ("old", "old-pw", False)):
            settings = EtcdSettings(endpoints=[server.url], user=user, password=password)
            async with Discovery(settings, "authns") as d:
                assert await d.readable(prefix) is readable, user


async def test_bad_router_records_are_counted_and_said_once_per_key_a_few_lines_at_most(
    ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """logonce audit of 2026-12-07, finding 2 (audit_scripts/etcd_burst.py): each bad put under
    /{ns}/routers/ was a WARNING of the watch in every shim, uncounted and uncapped."""
    caplog.set_level(logging.INFO)
    legs, clock = _Legs("a"), _Clock()
    orphans = _orphans(legs, clock)
    prefix = subjects.routers_prefix(ns)
    values = [b"not json", b'{"hello":1}', b'{"v":1,"router":"x"}', b"[]"]
    keys = ["badr", *(f"bad{i:02d}" for i in range(21))]

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "worker_shim.orphaned_legs"]

    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        events = d.watch_routers()

        async def read(refused: int) -> None:
            while orphans.records_refused < refused:
                orphans.update(await asyncio.wait_for(anext(events), 5.0))

        try:
            orphans.update(await anext(events))
            for i in range(100):
                await d.put_raw(prefix + "badr", values[i % len(values)])
            for key in keys[1:-1]:
                await d.put_raw(prefix + key, b"not json")
            await read(120)
            assert orphans.records_refused == 120 and orphans.live() == set()
            (line,) = said()  # one a window
            assert line.startswith("router record under key 'badr' ignored")
            assert line.endswith("(counted in kvswitch_shim_router_records_refused_total)")
            clock.now = 10.0  # the next window: the next key's line, with how many were held back
            await d.put_raw(prefix + keys[-1], b"not json")
            await read(121)
        finally:
            await events.aclose()
            for key in keys:
                await d.delete(prefix + key)
    assert not [r for r in caplog.records if r.name == "discovery.watch" and r.levelno >= logging.WARNING]
    assert len(said()) == 2 and "'bad20'" in said()[1], said()
    assert "(20 more such lines held back in the last 10 s)" in said()[1]


async def test_reason_changes_held_as_the_watch_ends_are_said_by_flush_in_one_line_and_never_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review of e1d08bd, finding 5 (r_shim_timer.py): a change held for its window's end was said by
    its timer after the shim had stopped, or never once the loop closed; and a flush through the
    throttle would never say it (a line of its key was said within RECORD_LINES_S)."""
    caplog.set_level(logging.WARNING, logger="worker_shim.orphaned_legs")
    legs, clock = _Legs(), _Clock()
    orphans = _orphans(legs, clock)
    orphans.update(Snapshot({}, 1, skipped={"badr": "reason A", "bad2": "reason C"}))  # bad2's line held back
    clock.now = 5.0
    orphans.update(Deleted("badr", 2, why="reason B"))  # held for the window's end, at 10 s
    orphans.update(Deleted("bad2", 3, why="reason D"))
    orphans.flush()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("router record under key 'badr' ignored") and "reason A" in said[0]
    assert said[1].startswith("router record under key 'badr' ignored") and "reason B (changes of its reason" in said[1]
    assert "(1 more such lines as the watch ended)" in said[1]
    assert said[1].endswith("(counted in kvswitch_shim_router_records_refused_total)")
    assert [key.timer for key in orphans._records._keys.values()] == [None, None]  # none to say it again later
    orphans.flush()
    assert len(caplog.records) == 2


async def test_a_reason_change_held_as_the_shim_stops_is_said_by_its_stop(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker_shim.orphaned_legs")
    key = subjects.routers_prefix(ns) + "badr"
    async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        try:
            async with shim_for(sim, ns, nats_url, etcd_url) as shim:
                await shim.registered.wait()
                orphans = shim.orphans
                assert orphans is not None
                await d.put_raw(key, b"not json")
                await wait_for(lambda: orphans.records_refused == 1, what="the bad record read")
                await d.put_raw(key, b"[]")  # another reason, within its window (10 s)
                await wait_for(lambda: orphans.records_refused == 2, what="its new reason read")
                assert len(caplog.records) == 1
        finally:
            await d.delete(key)
    said = [r.getMessage() for r in caplog.records]
    assert (
        len(said) == 2 and "Expected `object`, got `array` (changes of its reason since it was last said: 1)" in said[1]
    )


async def test_a_stop_waits_for_the_routers_watch_that_lost_its_cancellation_then_flushes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop within a stop: the shim's stop cancels its orphan watchdog, whose end waits on the
    routers' watch, the watch's etcd call having lost its cancellation. The stop cancelled the
    watchdog again past CANCEL_AGAIN_S and the watchdog's wait (cancel_and_wait) raised at once: the
    watch ran on past the stop, its stream's closing cut, and a reason change held for its window's
    end was never said (orphans.flush() skipped; a review of 2026-12-07). The WARNING named the
    watchdog, not the watch."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)  # 10 s in service
    lost: list[str] = []
    closed: list[bool] = []

    class Routers:
        async def readable(self, prefix: str) -> bool:
            return True

        async def watch_routers(self) -> AsyncGenerator[Snapshot[RouterInfo], None]:
            try:
                while True:
                    await never_answers(lost, "watch")
                    yield Snapshot({}, 1)
            finally:
                await asyncio.sleep(0.1)  # its stream's closing, on the cancellation that ends it
                closed.append(True)

    parts = {"_discovery": Routers(), "ns": "t", "task_failures": collections.Counter()}
    shim = cast(WorkerShim, type("Shim", (), parts)())  # what _follow_routers reads of a shim
    orphans = _orphans(_Legs(), _Clock())
    flushed: list[bool] = []
    monkeypatch.setattr(orphans, "flush", lambda: flushed.append(True))
    watchdog = asyncio.create_task(WorkerShim._follow_routers(shim, orphans), name="shim-routers")
    await asyncio.sleep(0.05)  # the watch is in its call
    with caplog.at_level(logging.WARNING, logger="runtime"):
        await cancel_and_wait(watchdog)  # WorkerShim._stop's
    assert lost == ["watch"] and closed == [True], "the stop ended before the routers' watch"
    assert flushed == [True], "orphans.flush() was skipped"
    said = [r.getMessage() for r in caplog.records if r.name == "runtime"]
    assert said == [
        "task shim-routers-watch ran on through its cancellation (lost below it): cancelled again 1 time(s) "
        "before it ended"
    ], said


async def test_etcd_gone_before_the_routers_first_read_is_said_once_not_a_crash_every_30_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """etcd stopped between the shim's connect and the routers' watch's first read (whether this
    worker may read them): the DiscoveryError reached keep_following, an ERROR with its traceback
    every 30 s for the whole outage (review of 2026-12-07). Now a WARNING, in the words of the
    watch's own read (discovery.watch.read_retried) with what to do, then an INFO once etcd answers
    and the watch runs."""
    caplog.set_level(logging.INFO)
    etcd = EtcdServer().start()
    try:
        async with Discovery(EtcdSettings(endpoints=[etcd.url]), "t") as d:
            tries = 0
            reading = d.readable

            async def counted(prefix: str) -> bool:
                nonlocal tries
                tries += 1
                return await reading(prefix)

            d.readable = counted  # type: ignore[method-assign]
            etcd.stop()
            parts = {
                "_discovery": d,
                "ns": "t",
                "task_failures": collections.Counter(),
                "worker_id": None,
                "registered": asyncio.Event(),
            }
            shim = cast(WorkerShim, type("Shim", (), parts)())  # what _follow_routers reads of a shim
            orphans = _orphans(_Legs(), _Clock())
            watchdog = asyncio.create_task(WorkerShim._follow_routers(shim, orphans), name="shim-routers")
            try:
                await wait_for(lambda: tries >= 3, timeout=60, what="3 reads with etcd gone")
                etcd.start()
                await wait_for(lambda: bool(_said(caplog, "works again")), timeout=30, what="etcd answering")
            finally:
                await cancel_and_wait(watchdog)
    finally:
        etcd.close()
    said = [r for r in caplog.records if r.name == "discovery.watch" and r.getMessage().startswith("watch /t/routers/")]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    warned = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("watch /t/routers/: reading it failed ("), warned
    assert warned[0].endswith("check --etcd-endpoints and the server); retrying, said again once it works"), warned
    assert "\n" not in warned[0]
    [back] = [r.getMessage() for r in said if r.levelno == logging.INFO]
    assert back.startswith("watch /t/routers/: reading it works again, after "), back


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "discovery.watch" and text in r.getMessage()]
