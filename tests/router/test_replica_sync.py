"""ReplicaSync: two replicas over a real nats-server (and etcd for the router watch)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import cast

import msgspec
import nats
import pytest
from nats.aio.client import Client

from discovery import Deleted, Discovery, Snapshot
from protocol import RouterInfo, subjects
from protocol.config import EtcdSettings
from protocol.messages import LoadReport, RouterSync, SyncEntry, encode_msg
from router.fleet_lines import NAMED_AT_MOST, FleetLog
from router.lifecycle import PartStatus
from router.load_view import LoadView
from router.replica_sync import ReplicaSync
from runtime import SHOWN_CHARS
from runtime.nats_flush import flush
from tests.router.polling import until


@pytest.fixture
async def pair(nc: Client, ns: str) -> AsyncIterator[tuple[ReplicaSync, ReplicaSync]]:
    a = ReplicaSync(nc, ns, "ra", LoadView(), flush_ms=1.0)
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    await a.start()
    await b.start()
    await flush(nc)
    yield a, b
    await a.stop()
    await b.stop()


async def test_a_booking_reaches_the_peer_and_its_release_follows(pair: tuple[ReplicaSync, ReplicaSync]) -> None:
    a, b = pair
    a.add("req1", "w1", 2000, 130)
    assert a.view.load("w1").prefill_tokens_queued == 2000  # booked here at once
    await until(lambda: b.view.bookings("w1") == 1)
    assert b.view.load("w1").prefill_tokens_queued == 2000
    assert b.view.load("w1").active_blocks == 130
    a.prefill_done("req1")
    await until(lambda: b.view.load("w1").prefill_tokens_queued == 0)
    assert b.view.load("w1").active_blocks == 130
    a.free("req1")
    await until(lambda: b.view.bookings("w1") == 0)
    assert a.view.bookings("w1") == 0


async def test_a_prefill_done_for_one_worker_ends_that_bookings_prefill_only(
    pair: tuple[ReplicaSync, ReplicaSync],
) -> None:
    """A remote request's prefill leg ended: its decode worker's blocks count on every replica until
    that worker's own first token (bookings audit, D1). Sent without a worker (worker ""), as an
    older replica sends every prefill_done, it still ends them all."""
    a, b = pair
    a.add("req1", "p", 2000, 0)
    a.add("req1", "d", 0, 130)
    a.prefill_done("req1", "p")
    await until(lambda: b.stats.entries_received == 3, what="b heard all three")
    for view in (a.view, b.view):
        view.update(LoadReport(worker="d", ts=time.time()))  # made after the prefill worker's part ended
        assert view.load("p").prefill_tokens_queued == 0
        assert view.load("d").active_blocks == 130
    a.prefill_done("req1")
    await until(lambda: b.stats.entries_received == 4, what="b heard the whole request's prefill_done")
    for view in (a.view, b.view):
        view.update(LoadReport(worker="d", ts=time.time()))
        assert view.load("d").active_blocks == 0  # d's report holds them from now on


async def test_a_peers_prefill_done_naming_a_worker_applies_to_that_worker_only(
    pair: tuple[ReplicaSync, ReplicaSync], nc: Client, ns: str
) -> None:
    _, b = pair
    entries = [
        SyncEntry(request_id="q", worker="p", kind="add", tokens=2000),
        SyncEntry(request_id="q", worker="d", kind="add", blocks=130),
        SyncEntry(request_id="q", worker="p", kind="prefill_done"),
    ]
    await nc.publish(subjects.sync(ns), encode_msg(RouterSync(router="rx", entries=entries)))
    await until(lambda: b.stats.entries_received == 3, what="b heard the peer")
    b.view.update(LoadReport(worker="d", ts=time.time()))
    assert b.view.load("p").prefill_tokens_queued == 0
    assert b.view.load("d").active_blocks == 130


async def test_own_messages_are_not_booked_twice(pair: tuple[ReplicaSync, ReplicaSync]) -> None:
    a, b = pair
    a.add("req1", "w1", 100, 1)
    b.add("req2", "w1", 10, 1)
    await until(lambda: a.view.bookings("w1") == 2 and b.view.bookings("w1") == 2)
    await until(lambda: a.stats.entries_received == 1 and b.stats.entries_received == 1)
    assert a.view.load("w1").prefill_tokens_queued == b.view.load("w1").prefill_tokens_queued == 110


async def test_same_request_id_on_two_replicas_stays_two_bookings(pair: tuple[ReplicaSync, ReplicaSync]) -> None:
    a, b = pair
    a.add("same", "w1", 100, 0)
    b.add("same", "w1", 50, 0)
    await until(lambda: a.view.bookings("w1") == 2 and b.view.bookings("w1") == 2)
    a.free("same")
    await until(lambda: b.view.bookings("w1") == 1)
    assert b.view.load("w1").prefill_tokens_queued == 50


async def test_entries_queued_together_go_in_one_message(pair: tuple[ReplicaSync, ReplicaSync]) -> None:
    a, b = pair
    for i in range(50):
        a.add(f"r{i}", f"w{i % 4}", 10, 1)
    await until(lambda: b.stats.entries_received == 50)
    assert a.stats.messages_sent == 1
    assert sum(b.view.bookings(f"w{i}") for i in range(4)) == 50


async def test_malformed_sync_is_counted_and_dropped(
    pair: tuple[ReplicaSync, ReplicaSync], nc: Client, ns: str
) -> None:
    a, b = pair
    await nc.publish(subjects.sync(ns), b"\x00garbage")
    bad = RouterSync(router="rx", entries=[SyncEntry(request_id="q", worker="w1", kind="add", tokens=-1)])
    await nc.publish(subjects.sync(ns), encode_msg(bad))
    a.add("req1", "w1", 5, 0)
    await until(lambda: b.view.bookings("w1") == 1 and b.stats.malformed == 2)
    assert b.view.load("w1").prefill_tokens_queued == 5


async def test_peer_bookings_expire_after_the_ttl(nc: Client, ns: str) -> None:
    a = ReplicaSync(nc, ns, "ra", LoadView(), flush_ms=1.0)
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, peer_ttl_s=0.2)
    await a.start()
    await b.start()
    try:
        a.add("req1", "w1", 5, 1)
        await until(lambda: b.view.bookings("w1") == 1)
        await until(lambda: b.view.bookings("w1") == 0)
        assert b.stats.bookings_expired == 1
        assert a.view.bookings("w1") == 1  # our own bookings never expire by age
    finally:
        await a.stop()
        await b.stop()


async def test_stop_sends_what_is_queued_and_is_idempotent(pair: tuple[ReplicaSync, ReplicaSync]) -> None:
    a, b = pair
    a.add("req1", "w1", 5, 1)
    await a.stop()
    await a.stop()
    assert a.status is PartStatus.STOPPED
    await until(lambda: b.view.bookings("w1") == 1)


async def test_a_peer_whose_key_goes_loses_its_bookings(nc: Client, ns: str, etcd_url: str) -> None:
    settings = EtcdSettings(endpoints=[etcd_url])
    async with Discovery(settings, ns) as disc_a, Discovery(settings, ns) as disc_b:
        lease = await disc_a.register_router(
            lambda rid: RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=time.time()), ttl=5
        )
        a = ReplicaSync(nc, ns, lease.hex_id, LoadView(), flush_ms=1.0)
        b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, discovery=disc_b)
        await a.start()
        await b.start()
        try:
            # b drops messages from routers it has not yet seen in etcd, so wait for its watch.
            await until(lambda: b.registered(lease.hex_id) is True, what="a registered")
            a.add("req1", "w1", 100, 10)
            await until(lambda: b.view.bookings("w1") == 1)
            await disc_a.release(lease)
            await until(lambda: b.view.bookings("w1") == 0)
            assert b.stats.routers_forgotten == 1
            a.add("req2", "w1", 100, 10)  # a late message from the departed peer
            await until(lambda: a.stats.messages_sent == 2)
            # A third, registered router's message sent after it: once b has that, b has seen the late one.
            rc = await disc_a.register_router(
                lambda rid: RouterInfo(router=rid, http_url="http://127.0.0.1:2", started_at=time.time()), ttl=5
            )
            probe = RouterSync(router=rc.hex_id, entries=[SyncEntry(request_id="p", worker="w2", kind="add")])
            await until(lambda: b.registered(rc.hex_id) is True, what="rc registered")
            await nc.publish(subjects.sync(ns), encode_msg(probe))
            await until(lambda: b.view.bookings("w2") == 1)
            assert b.view.bookings("w1") == 0
        finally:
            await a.stop()
            await b.stop()


async def test_bookings_of_an_unregistered_router_do_not_count(nc: Client, ns: str, etcd_url: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as disc:
        b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, discovery=disc)
        await b.start()
        try:
            await until(lambda: b.registered("rb") is False, what="the routers' snapshot")
            entry = SyncEntry(request_id="x", worker="w1", kind="add", blocks=10**7)
            forged = RouterSync(router="forger", entries=[entry])
            await nc.publish(subjects.sync(ns), encode_msg(forged))
            await until(lambda: b.stats.unregistered == 1, what="the forged message dropped")
            assert b.view.bookings("w1") == 0 and b.view.load("w1").active_blocks == 0
        finally:
            await b.stop()


def _info(rid: str) -> RouterInfo:
    return RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=time.time())


async def test_a_lone_replica_publishes_nothing(nc: Client, ns: str, etcd_url: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as disc:
        lease = await disc.register_router(_info, ttl=5)
        a = ReplicaSync(nc, ns, lease.hex_id, LoadView(), flush_ms=1.0, discovery=disc)
        await a.start()
        try:
            await until(lambda: a.registered(lease.hex_id) is True, what="the routers' snapshot")
            a.add("req1", "w1", 100, 10)
            a.free("req1")
            await asyncio.sleep(0.05)
            assert a.stats.messages_sent == 0 and a.view.bookings("w1") == 0
        finally:
            await a.stop()


async def test_a_free_sent_while_the_only_peer_reregisters_reaches_it(nc: Client, ns: str, etcd_url: str) -> None:
    """An HA pair: B's lease is lost (a stall past its TTL), so A sees no other router's key while
    B, still running, holds A's booking. A's free in that window must reach B, which registers
    anew; dropped, B kept the booking for peer_ttl_s (600 s)."""
    settings = EtcdSettings(endpoints=[etcd_url])
    async with Discovery(settings, ns) as disc_a, Discovery(settings, ns) as disc_b:
        lease_a = await disc_a.register_router(_info, ttl=5)
        lease_b = await disc_b.register_router(_info, ttl=5)
        a = ReplicaSync(nc, ns, lease_a.hex_id, LoadView(), flush_ms=1.0, discovery=disc_a)
        b = ReplicaSync(nc, ns, lease_b.hex_id, LoadView(), flush_ms=1.0, discovery=disc_b)
        await a.start()
        await b.start()
        try:
            await until(lambda: bool(a.registered(lease_b.hex_id) and b.registered(lease_a.hex_id)), what="both keys")
            a.add("req1", "w1", 2000, 130)
            await until(lambda: b.view.bookings("w1") == 1, what="b holds a's booking")
            await disc_b.release(lease_b)
            await until(lambda: a.registered(lease_b.hex_id) is False, what="a saw b's key go")
            a.prefill_done("req1")
            a.free("req1")
            await until(lambda: a.stats.entries_sent == 3, timeout=2.0, what="a's free published")
            lease_b2 = await disc_b.register_router(_info, ttl=5)
            b.rename(lease_b2.hex_id)  # as RouterService._registered_anew
            await until(lambda: b.view.bookings("w1") == 0, timeout=2.0, what="b dropped a's ended request")
            assert b.view.load("w1").active_blocks == 0
        finally:
            await a.stop()
            await b.stop()


async def test_drops_from_departed_and_unregistered_senders_are_counted_and_logged_once_per_sender(
    nc: Client, ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    settings = EtcdSettings(endpoints=[etcd_url])
    async with Discovery(settings, ns) as disc_a, Discovery(settings, ns) as disc_b:
        lease_a = await disc_a.register_router(_info, ttl=5)
        b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, discovery=disc_b)
        await b.start()
        try:
            await until(lambda: b.registered(lease_a.hex_id) is True, what="a registered")
            await disc_a.release(lease_a)
            await until(lambda: b.registered(lease_a.hex_id) is False, what="a's key gone")
            entry = SyncEntry(request_id="x", worker="w1", kind="add", blocks=1)
            for sender in (lease_a.hex_id, lease_a.hex_id, "forger", "forger", "forger2"):
                await nc.publish(subjects.sync(ns), encode_msg(RouterSync(router=sender, entries=[entry])))
            await until(lambda: b.stats.departed == 2 and b.stats.unregistered == 3, what="every message dropped")
            assert b.view.bookings("w1") == 0
            said = [r.getMessage() for r in caplog.records if "dropping router sync from" in r.getMessage()]
            assert len(said) == 2 and "from 'forger' " in said[0] and "from 'forger2' " in said[1], said
            assert subjects.routers_prefix(ns) in said[0]
        finally:
            await b.stop()


async def test_a_router_whose_key_comes_back_in_a_fresh_snapshot_is_heard_again(nc: Client, ns: str) -> None:
    """A router key deleted, then put back (by its registration) while this watch was being made
    again: the put reaches this router only inside the new Snapshot. Before, only a Put took the
    name out of the departed ones, and its bookings were dropped for good."""
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    await b.start()
    try:
        both = Snapshot({"ra": _info("ra"), "rb": _info("rb")}, 1, {})
        for event in (both, Deleted("ra", 2), both):
            b.on_routers_event(event)
        entry = SyncEntry(request_id="x", worker="w1", kind="add", blocks=1)
        await nc.publish(subjects.sync(ns), encode_msg(RouterSync(router="ra", entries=[entry])))
        await until(lambda: b.stats.entries_received == 1, what="ra's booking taken")
        assert b.view.bookings("w1") == 1 and b.stats.departed == 0
    finally:
        await b.stop()


async def _echo_of_the_old_id_then_a_peers_booking(nc: Client, ns: str, old: str, peer: str, b: ReplicaSync) -> None:
    """Our booking as published under our old id just before the rename, echoed back by NATS; then,
    on the same connection so after it, the peer's booking on another worker: once that one is in,
    the echo was handled."""
    echo = SyncEntry(request_id="r1", worker="w1", kind="add", tokens=10, blocks=3)
    await nc.publish(subjects.sync(ns), encode_msg(RouterSync(router=old, entries=[echo])))
    peers = SyncEntry(request_id="r2", worker="w2", kind="add", tokens=10, blocks=3)
    await nc.publish(subjects.sync(ns), encode_msg(RouterSync(router=peer, entries=[peers])))
    await until(lambda: b.view.bookings("w2") == 1, what="the peer's booking taken")


async def test_an_echo_under_our_id_from_before_a_rename_whose_key_went_first_is_dropped_quietly(
    nc: Client, ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Audit of mod-ingest: forget_router skips our own id, so once renamed the old one was any
    unregistered sender's: the echo said a WARNING of a forged sender, naming this router."""
    caplog.set_level(logging.INFO, logger="router.replica_sync")
    settings = EtcdSettings(endpoints=[etcd_url])
    async with Discovery(settings, ns) as disc, Discovery(settings, ns) as disc_a:
        peer = await disc_a.register_router(_info, ttl=5)
        lease = await disc.register_router(_info, ttl=5)
        b = ReplicaSync(nc, ns, lease.hex_id, LoadView(), flush_ms=1.0, discovery=disc)
        await b.start()
        try:
            await until(lambda: bool(b.registered(lease.hex_id) and b.registered(peer.hex_id)), what="both keys")
            b.add("r1", "w1", 10, 3)
            await disc.release(lease)  # our lease lost
            await until(lambda: b.registered(lease.hex_id) is False, what="our old key gone")
            b.rename((await disc.register_router(_info, ttl=5)).hex_id)  # as RouterService._registered_anew
            await _echo_of_the_old_id_then_a_peers_booking(nc, ns, lease.hex_id, peer.hex_id, b)
            assert b.view.bookings("w1") == 1 and (b.stats.unregistered, b.stats.departed) == (0, 0)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        finally:
            await b.stop()


async def test_an_echo_under_our_id_from_before_a_rename_whose_key_goes_later_is_not_booked_twice(
    nc: Client, ns: str, etcd_url: str
) -> None:
    """Audit of mod-ingest: renamed before the watch saw the old key go, the echo came from a
    registered router: our own booking counted again, as a peer's, in our load view."""
    settings = EtcdSettings(endpoints=[etcd_url])
    async with Discovery(settings, ns) as disc, Discovery(settings, ns) as disc_a:
        peer = await disc_a.register_router(_info, ttl=5)
        lease = await disc.register_router(_info, ttl=5)
        b = ReplicaSync(nc, ns, lease.hex_id, LoadView(), flush_ms=1.0, discovery=disc)
        await b.start()
        try:
            await until(lambda: bool(b.registered(lease.hex_id) and b.registered(peer.hex_id)), what="both keys")
            b.add("r1", "w1", 10, 3)
            b.rename((await disc.register_router(_info, ttl=5)).hex_id)
            await _echo_of_the_old_id_then_a_peers_booking(nc, ns, lease.hex_id, peer.hex_id, b)
            assert b.view.bookings("w1") == 1 and b.view.load("w1").active_blocks == 3
            await disc.release(lease)
            await until(lambda: b.stats.routers_forgotten == 1, what="the old id forgotten")
            assert b.view.bookings("w1") == 1
        finally:
            await b.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def peer_adds(peer: str, *request_ids: str) -> bytes:
    entries = [SyncEntry(request_id=r, worker="w1", kind="add", tokens=8, blocks=2) for r in request_ids]
    return encode_msg(RouterSync(router=peer, entries=entries))


def peer_done(peer: str, *request_ids: str) -> bytes:
    entries = [SyncEntry(request_id=r, worker="w1", kind="prefill_done") for r in request_ids]
    return encode_msg(RouterSync(router=peer, entries=entries))


NO_RELEASE = (
    "router sync: {n} booking(s) of peer router {peer} got no release within 600 s, and no snapshot of that router "
    "named them: it sends none (a kvswitch before 2026-12-07), and its free was lost (e.g. published while NATS was "
    "down) or its request ran longer than that (--request-timeout above 600 s); or its snapshots stopped reaching "
    "this router. Until now they counted in their worker's load"
)


async def test_an_expired_peer_booking_that_still_counted_is_said_once_per_peer_with_its_count(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 a lost release's booking expired as a count only (replica audit): nothing
    said that a peer's free never came while its blocks counted on its worker for 600 s."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    clock = Clock()
    b = ReplicaSync(nc, ns, "rb", LoadView(clock=clock), peer_ttl_s=600.0)
    b._on_payload(peer_adds("ra", "q1#1", "q2#1"))
    b._on_payload(peer_adds("rc", "q3#1"))
    clock.now += 599
    b._expire()
    assert not caplog.records
    clock.now += 2
    b._expire()
    b._expire()  # nothing more to say
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, NO_RELEASE.format(n=2, peer="ra")),
        (logging.WARNING, NO_RELEASE.format(n=1, peer="rc")),
    ]
    assert b.stats.bookings_expired == 3


async def test_a_long_request_past_its_first_token_expires_with_no_warning(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of f894988 (2026-12-07): a peer's request running longer than 600 s (--request-timeout
    above it) was said to have lost its free, though its booking had long stopped counting (its
    first token came and its worker's report covers it); it is only counted now."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    clock = Clock()
    b = ReplicaSync(nc, ns, "rb", LoadView(clock=clock), peer_ttl_s=600.0)
    b._on_payload(peer_adds("ra", "long#1"))
    b._on_payload(peer_adds("rc", "lost#1", "long#2"))
    b._on_payload(peer_done("ra", "long#1"))
    b._on_payload(peer_done("rc", "long#2"))
    clock.now += 1
    b.view.update(LoadReport(worker="w1", ts=clock.now, kv_total_blocks=100))
    assert b.view.load("w1").active_blocks == 2  # lost#1's only
    clock.now += 600
    b._expire()
    assert [r.getMessage() for r in caplog.records] == [NO_RELEASE.format(n=1, peer="rc")]
    assert b.stats.bookings_expired == 3


async def test_expiry_names_a_few_peers_a_pass_and_counts_the_rest_in_one_line(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    clock = Clock()
    b = ReplicaSync(nc, ns, "rb", LoadView(clock=clock), peer_ttl_s=600.0)
    for i in range(12):
        b._on_payload(peer_adds(f"r{i:02d}", f"q{i}#1"))
    clock.now += 601
    b._expire()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 9
    assert said[-1] == (
        "router sync: 4 more booking(s) of 4 more peer routers got no release within 600 s (the same causes)"
    )


async def test_malformed_sync_is_logged_once_per_peer(nc: Client, ns: str, caplog: pytest.LogCaptureFixture) -> None:
    """Until 2026-12-06 one line per process: a second peer gone wrong was only a count."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    await b.start()
    try:
        for peer in ("rx", "ry", "rx"):
            bad = RouterSync(router=peer, entries=[SyncEntry(request_id="q", worker="w1", kind="add", tokens=-1)])
            await nc.publish(subjects.sync(ns), encode_msg(bad))
        await nc.publish(subjects.sync(ns), b"\x00garbage")
        await until(lambda: b.stats.malformed == 4)
        said = [r.getMessage() for r in caplog.records if "malformed router sync" in r.getMessage()]
        assert [line.split(" (")[0] for line in said] == [
            "dropping malformed router sync from router rx",
            "dropping malformed router sync from router ry",
            "dropping malformed router sync from a sender it does not name",
        ]
        b.forget_router("rx")  # gone, then back under its name: said again
        b._departed.remove("rx")
        bad = RouterSync(router="rx", entries=[SyncEntry(request_id="q2", worker="w1", kind="add", tokens=-1)])
        await nc.publish(subjects.sync(ns), encode_msg(bad))
        await until(lambda: b.stats.malformed == 5)
        assert sum("from router rx" in r.getMessage() for r in caplog.records) == 2
    finally:
        await b.stop()


# --- logonce audit of 2026-12-07: newer peers, and bad router records ---------------------------


async def test_a_sync_entry_of_a_kind_a_newer_router_adds_is_skipped_and_the_others_applied(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 6 (audit_scripts/sync_newkind.py): a valid add beside an entry of kind "requeue" was
    one malformed message, the add lost with it, and not a word: the sender's one line was used."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    await b.start()
    try:
        for i in range(2):
            entries = [
                {"request_id": f"req-{i}", "worker": "w1", "kind": "add", "tokens": 100, "blocks": 7},
                {"request_id": f"req-{i}b", "worker": "w1", "kind": "requeue", "tokens": 1, "blocks": 1},
            ]
            await nc.publish(subjects.sync(ns), msgspec.msgpack.encode({"v": 1, "router": "rx", "entries": entries}))
        await until(lambda: b.stats.entries_received == 2, what="both adds taken")
        assert b.view.bookings("w1") == 2 and b.view.load("w1").active_blocks == 14
        assert b.stats.malformed == 0 and b.stats.entries_unknown == {"requeue": 2}
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("router sync from router rx holds entries of kind 'requeue', which this router does")
        assert "newer kvswitch" in line and "kvswitch_router_sync_entries_unknown_total" in line
    finally:
        await b.stop()


async def test_a_newer_peers_message_is_named_and_said_apart_from_garbage(
    nc: Client, ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 6: every message that did not decode shared one unnamed line, used by the first
    garbage: a v 2 router's, whose router field decodes, then went unnamed and unsaid."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as disc:
        lease = await disc.register_router(_info, ttl=5)
        peer = lease.hex_id
        b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, discovery=disc)
        await b.start()
        try:
            await until(lambda: b.registered(peer) is True, what="the peer registered")
            newer = {"v": 2, "entries": []}
            for payload in (
                b"\x00garbage",  # unnamed
                msgspec.msgpack.encode({**newer, "router": "rnew"}),  # named, though it has no key here
                msgspec.msgpack.encode({**newer, "router": "rnew"}),  # said once
                msgspec.msgpack.encode({"router": peer, "entries": 5}),  # a registered peer's garbage
                msgspec.msgpack.encode({**newer, "router": peer}),  # and its newer schema: a slot of its own
                msgspec.msgpack.encode({"router": "forger", "entries": 5}),  # no key: the unnamed garbage's slot
            ):
                await nc.publish(subjects.sync(ns), payload)
            await until(lambda: b.stats.malformed == 6, what="every message counted")
            said = [r.getMessage() for r in caplog.records]
            assert len(said) == 4, said
            assert said[0].startswith("dropping malformed router sync from a sender it does not name")
            unregistered = f"dropping malformed router sync from router 'rnew', which has no key under /{ns}"
            assert said[1].startswith(unregistered)
            assert f"router {peer} (" in said[2] and "newer schema" not in said[2]
            assert f"router {peer} (" in said[3]
            for line in (said[1], said[3]):
                assert "newer schema version (2)" in line and "upgrade this process" in line
        finally:
            await b.stop()


async def test_names_in_sync_messages_before_the_first_snapshot_take_no_slot_and_are_shown_quoted_and_cut(
    nc: Client, ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of e1d08bd, finding 2 (r_sync_slots.py): before the routers watch's first snapshot,
    any name in an undecodable message took a once-slot of its own, for good: 64 messages naming
    forged00..forged63 took every slot, and a registered peer's newer kinds, impossible booking and
    newer schema were then counted, never said. A name was logged as sent: a 200 KB name made a
    200 KB line, and one holding a line break forged a line of its own."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    long = "x" * 200_000 + "\nCRITICAL forged line"
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as disc:
        b = ReplicaSync(nc, ns, "rb", LoadView(), discovery=disc)  # not started: its snapshot handed to it below
        b._on_payload(msgspec.msgpack.encode({"router": long, "entries": 5}))
        for i in range(64):
            b._on_payload(msgspec.msgpack.encode({"router": f"forged{i:02d}", "entries": 5}))
        b.on_routers_event(Snapshot(items={"rpeer": _info("rpeer")}, revision=1))
        b._on_payload(msgspec.msgpack.encode({"router": long, "entries": []}))  # decodes: unregistered
        entries = [{"request_id": "q1", "worker": "w1", "kind": "requeue"}]
        b._on_payload(msgspec.msgpack.encode({"router": "rpeer", "entries": entries}))
        b._on_payload(
            encode_msg(
                RouterSync(router="rpeer", entries=[SyncEntry(request_id="q2", worker="w1", kind="add", tokens=2**40)])
            )
        )
        b._on_payload(msgspec.msgpack.encode({"v": 2, "router": "rpeer", "entries": []}))
    assert b.stats.malformed == 67 and b.stats.unregistered == 1 and b.stats.entries_unknown == {"requeue": 1}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 5, said
    shown = repr(long)[: SHOWN_CHARS - 3] + "..."
    assert said[0].startswith(f"dropping malformed router sync from router {shown}, not yet read under /{ns}/")
    assert said[1].startswith(f"dropping router sync from {shown} (0 entries): no key of its under /{ns}/")
    assert said[2].startswith("router sync from router rpeer holds entries of kind 'requeue'")
    assert (
        said[3].startswith("dropping malformed router sync from router rpeer (") and "1099511627776 tokens" in said[3]
    )
    assert said[4].startswith("dropping malformed router sync from router rpeer (") and "newer schema" in said[4]
    assert all("\n" not in line and len(line) < 2 * SHOWN_CHARS for line in said)


async def test_a_sync_message_that_does_not_decode_is_never_decoded_untyped(
    nc: Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of e1d08bd, finding 3: an undecodable message was decoded untyped twice, in search of
    an unknown kind and of its router field (0.8 MB of garbage: 0.002 ms, then 27 ms, on the
    router's one loop, from any publisher on the subject)."""
    untyped: list[int] = []
    decode = msgspec.msgpack.decode

    def counted(data: bytes, **kw: object) -> object:
        untyped.append(len(data))
        return decode(data, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(msgspec.msgpack, "decode", counted)
    b = ReplicaSync(nc, ns, "rb", LoadView())
    entries = [{"request_id": f"q{i}", "worker": "w1", "kind": "add", "tokens": 1.5, "blocks": 1} for i in range(1000)]
    b._on_payload(msgspec.msgpack.encode({"router": "rx", "entries": entries}))
    assert b.stats.malformed == 1 and untyped == []


async def test_bad_router_records_are_counted_said_once_per_key_capped_and_forget_no_peer(
    nc: Client, ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Findings 2 (audit_scripts/etcd_burst.py): each bad put under /{ns}/routers/ was a WARNING of
    the watch in every router, uncounted and uncapped (identical values too), and read as a
    Deleted: kvswitch_router_sync_peers_forgotten_total rose once per put, for peers that never
    existed."""
    caplog.set_level(logging.INFO)
    prefix = subjects.routers_prefix(ns)
    values = [b"not json", b'{"hello":1}', b'{"v":1,"router":"x"}', b"[]"]
    held_by = FleetLog()
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as disc:
        b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, discovery=disc, fleet_log=held_by)
        await b.start()
        try:
            await until(lambda: b.registered("rb") is False, what="the routers' snapshot")
            for i in range(200):
                await disc.put_raw(prefix + "badr", values[i % len(values)])
            for i in range(30):
                await disc.put_raw(prefix + f"bad{i:02d}", b"not json")
            await until(lambda: b.stats.records_refused == 230, what="every bad put read")
            for i in range(30):
                await disc.put_raw(prefix + f"bad{i:02d}", b"not json")  # the same value again
            await until(lambda: b.stats.records_refused == 260, what="every put read again")
            assert b.stats.routers_forgotten == 0 and b.registered("badr") is False
        finally:
            await b.stop()
            held_by.flush()
            for i in range(30):
                await disc.delete(prefix + f"bad{i:02d}")
            await disc.delete(prefix + "badr")
    assert not [r for r in caplog.records if r.name == "discovery.watch" and r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in caplog.records if r.name == "router.replica_sync"]
    named = [m for m in said if m.startswith("router record under key")]
    summary = [m for m in said if m.startswith("and ")]
    badr = [m for m in named if "'badr'" in m]
    # the first put's reason, then (as it stops: within its window) the reason now and the changes
    assert badr == [
        "router record under key 'badr' ignored: malformed RouterInfo: JSON is malformed: invalid character (byte 4)",
        "router record under key 'badr' ignored: malformed RouterInfo: Expected `object`, got `array` (changes of "
        "its reason since it was last said: 199)",
    ], badr
    assert len(named) == 2 + NAMED_AT_MOST - 1  # badr's two, and the first of the other keys
    assert summary == [
        f"and {30 - NAMED_AT_MOST + 1} more keys: router records under {prefix} ignored (one cause for many keys "
        "at once: routers of a build whose records this router cannot read, or a writer other than the routers; "
        "counted in kvswitch_router_router_records_refused_total)"
    ], summary


class _DroppingNats:
    """A connection that publishes `fails_at` messages, then fails each publish (NATS dropped mid-flush)."""

    max_payload = 1 << 20

    def __init__(self, fails_at: int) -> None:
        self.fails_at = fails_at
        self.published: list[bytes] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        if len(self.published) >= self.fails_at:
            raise nats.errors.ConnectionClosedError
        self.published.append(payload)


@pytest.mark.parametrize(
    ("fails_at", "said"),
    [
        (0, r"1 entry and a snapshot of 1201 bookings \(\d+ bytes in 3 messages\)"),
        (2, r"parts 2-3 of 3 of a snapshot of 1201 bookings \(\d+ bytes\)"),
        (3, r"part 3 of 3 of a snapshot of 1201 bookings \(\d+ bytes\)"),
    ],
)
async def test_a_failed_publish_says_which_snapshot_parts_were_not_sent(
    fails_at: int, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A flush of one entry and a snapshot of three parts, its publishes failing from the
    `fails_at`th on: the line names what went unsent. Until 2026-12-07 it named the whole snapshot
    where only its later parts failed (its entry too, as "0 entries")."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    nc = _DroppingNats(fails_at)
    a = ReplicaSync(cast(Client, nc), ns="t", router_id="ra", view=LoadView())
    for i in range(1200):  # snapshot parts hold 500 bookings: three parts with the add below
        a.view.book(f"r{i}", "w1", 10, 1)
    a.add("new", "w1", 10, 1)
    a._snapshot_due = True
    await a._send()
    assert len(nc.published) == fails_at and a.stats.send_failures == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and re.fullmatch(rf"router sync: {said} not sent \(.*\)", lines[0]), lines
