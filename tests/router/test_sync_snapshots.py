"""Replica sync's snapshots heal a lost sync message within a period or two, over a real nats-server.

Until 2026-12-07 a lost `free` (NATS core is at-most-once: one published while NATS was down is
flushed on reconnect before the peers have subscribed again) left a stale booking on every peer for
`peer_ttl_s` (600 s), steering traffic away from an idle worker; a lost `add` or `prefill_done` never
healed before the request's free or that expiry (docs/router.md, "Lost releases"). A message is lost
here as in that outage: the peer's subscription is gone while it is published."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client

from protocol import ConfigError, subjects
from protocol.messages import LoadReport, RouterSync, SyncBooking, SyncEntry, SyncSnapshot, decode_msg, encode_msg
from router import cli
from router.load_view import LoadView
from router.replica_sync import ReplicaSync
from runtime import guarded
from runtime.nats_flush import flush
from tests.router.polling import until
from tests.router.test_cli_refusals import _args
from tests.router.test_replica_sync import Clock

PERIOD_S = 0.2
HEAL_S = 10 * PERIOD_S  # a period or two, on a loaded machine


@pytest.fixture
async def pair(nc: Client, ns: str) -> AsyncIterator[tuple[ReplicaSync, ReplicaSync]]:
    a = ReplicaSync(nc, ns, "ra", LoadView(), flush_ms=1.0, snapshot_s=PERIOD_S)
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, snapshot_s=PERIOD_S)
    b.view.update(LoadReport(worker="w1", ts=time.time(), kv_total_blocks=10_000))
    await a.start()
    await b.start()
    await flush(nc)
    await until(lambda: b.stats.snapshots_taken >= 1, what="b read a's first snapshot")
    yield a, b
    await a.stop()
    await b.stop()


@contextlib.asynccontextmanager
async def missed_by(b: ReplicaSync, nc: Client, ns: str) -> AsyncIterator[None]:
    """`b` hears nothing on the sync subject meanwhile, as a peer not yet subscribed again after
    NATS came back."""
    assert b._sub is not None
    await b._sub.unsubscribe()
    await flush(nc)
    try:
        yield
    finally:
        await flush(nc)  # what was published meanwhile has passed b by
        b._sub = await nc.subscribe(subjects.sync(ns), cb=guarded(b._on_msg, "the replica sync handler"))
        await flush(nc)


async def test_a_lost_free_heals_at_the_next_snapshot(
    pair: tuple[ReplicaSync, ReplicaSync], nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    a, b = pair
    a.add("req1", "w1", 2000, 130)
    await until(lambda: b.view.bookings("w1") == 1, what="b holds a's booking")
    async with missed_by(b, nc, ns):
        a.free("req1")
        await until(lambda: a.stats.entries_sent == 2, what="a sent the free")
        await flush(nc)
        assert b.view.load("w1").active_blocks == 130  # stale: an idle worker reads as busy here
    await until(lambda: b.view.bookings("w1") == 0, timeout=HEAL_S, what="the stale booking dropped")
    assert b.stats.healed == {"added": 0, "dropped": 1, "state": 0}
    assert b.view.load("w1").active_blocks == 0
    await until(lambda: any("healed" in r.getMessage() for r in caplog.records), what="the heal said")
    assert [r.getMessage() for r in caplog.records] == [
        "router sync: snapshots of peer router ra healed 1 booking(s) dropped (their free was lost): messages of "
        "its did not reach this router (e.g. published while NATS was down)"
    ]


async def test_a_lost_add_heals_and_a_worker_with_no_report_here_gets_none(
    pair: tuple[ReplicaSync, ReplicaSync], nc: Client, ns: str
) -> None:
    a, b = pair
    async with missed_by(b, nc, ns):
        a.add("req1", "w1", 2000, 130)
        a.add("req2", "gone", 10, 1)  # a worker b no longer has (or has no report of yet)
        await until(lambda: a.stats.entries_sent == 2, what="a sent the adds")
        await flush(nc)
        assert b.view.bookings("w1") == 0
    await until(lambda: b.view.bookings("w1") == 1, timeout=HEAL_S, what="the lost booking added")
    load = b.view.load("w1")
    assert (load.prefill_tokens_queued, load.active_blocks) == (2000, 130)
    assert b.stats.healed == {"added": 1, "dropped": 0, "state": 0}
    assert b.view.bookings("gone") == 0
    a.free("req1")  # the booking healed in is the one its free ends
    await until(lambda: b.view.bookings("w1") == 0, what="its free applied")


async def test_a_lost_prefill_done_heals(pair: tuple[ReplicaSync, ReplicaSync], nc: Client, ns: str) -> None:
    a, b = pair
    a.add("req1", "w1", 2000, 130)
    await until(lambda: b.view.load("w1").prefill_tokens_queued == 2000, what="b holds a's booking")
    async with missed_by(b, nc, ns):
        a.prefill_done("req1")
        await until(lambda: a.stats.entries_sent == 2, what="a sent the prefill_done")
        await flush(nc)
        assert b.view.load("w1").prefill_tokens_queued == 2000
    await until(lambda: b.view.load("w1").prefill_tokens_queued == 0, timeout=HEAL_S, what="the prefill ended")
    assert b.view.load("w1").active_blocks == 130  # its decode blocks still count, as on a
    assert b.stats.healed == {"added": 0, "dropped": 0, "state": 1}


def snapshot(seq: int, part: int, parts: int, *request_ids: str) -> bytes:
    bookings = [SyncBooking(request_id=r, worker="w1", tokens=8, blocks=2) for r in request_ids]
    return encode_msg(
        RouterSync(router="ra", entries=[], snapshot=SyncSnapshot(seq=seq, part=part, parts=parts, bookings=bookings))
    )


def adds(*request_ids: str) -> bytes:
    entries = [SyncEntry(request_id=r, worker="w1", kind="add", tokens=8, blocks=2) for r in request_ids]
    return encode_msg(RouterSync(router="ra", entries=entries))


@pytest.fixture
async def b(nc: Client, ns: str) -> AsyncIterator[ReplicaSync]:
    """A replica whose peer "ra" the test plays, publishing its messages (or losing them) itself."""
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    b.view.update(LoadReport(worker="w1", ts=time.time(), kv_total_blocks=10_000))
    await b.start()
    yield b
    await b.stop()


async def publish(nc: Client, ns: str, *payloads: bytes) -> None:
    for payload in payloads:
        await nc.publish(subjects.sync(ns), payload)
    await flush(nc)


async def test_a_snapshot_with_a_part_missing_drops_nothing_and_the_next_whole_one_does(
    b: ReplicaSync, nc: Client, ns: str
) -> None:
    await publish(nc, ns, adds("live", "stale"))  # stale: its free is lost
    await until(lambda: b.view.bookings("w1") == 2, what="both booked")
    await publish(nc, ns, snapshot(1, 1, 2))  # part 0 lost
    await publish(nc, ns, snapshot(2, 0, 3, "live"), snapshot(2, 2, 3))  # part 1 lost
    await until(lambda: b.stats.snapshots_incomplete == 2, what="both snapshots read")
    assert b.view.bookings("w1") == 2
    assert b.stats.snapshots_taken == 0
    await publish(nc, ns, snapshot(3, 0, 2, "live"), snapshot(3, 1, 2))
    await until(lambda: b.stats.snapshots_taken == 1, what="the whole snapshot read")
    assert b.view.keys("ra") == {("live", "w1")}
    assert b.stats.healed == {"added": 0, "dropped": 1, "state": 0}
    assert b.stats.snapshots_incomplete == 2


async def test_a_booking_added_while_a_snapshot_is_read_is_not_swept(b: ReplicaSync, nc: Client, ns: str) -> None:
    await publish(nc, ns, adds("old", "stale"))
    await until(lambda: b.view.bookings("w1") == 2, what="both booked")
    # "stale" was freed and booked again between the parts: the add, not the snapshot, is the news
    await publish(nc, ns, snapshot(1, 0, 2, "old"), adds("new", "stale"), snapshot(1, 1, 2))
    await until(lambda: b.stats.snapshots_taken == 1, what="the snapshot read")
    assert b.view.keys("ra") == {("old", "w1"), ("new", "w1"), ("stale", "w1")}
    assert b.stats.healed == {"added": 0, "dropped": 0, "state": 0}


async def test_a_peers_first_snapshot_adds_what_this_router_came_too_late_to_hear_without_a_word(
    b: ReplicaSync, nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A router started (or registered) after its peer booked a request heard no add of it: the
    first snapshot brings it, which is no message lost; a second one's add is."""
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    await publish(nc, ns, snapshot(7, 0, 1, "before"))
    await until(lambda: b.view.bookings("w1") == 1, what="the first snapshot read")
    await publish(nc, ns, snapshot(8, 0, 1, "before", "lost"))
    await until(lambda: b.view.bookings("w1") == 2, what="the second snapshot read")
    assert b.stats.healed == {"added": 1, "dropped": 0, "state": 0}
    b._say_healed()
    assert [r.getMessage() for r in caplog.records] == [
        "router sync: snapshots of peer router ra healed 1 booking(s) added (their add was lost): messages of its "
        "did not reach this router (e.g. published while NATS was down)"
    ]


async def test_snapshot_bookings_are_checked_as_entries_are(
    b: ReplicaSync, nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    huge = SyncBooking(request_id="huge", worker="w1", blocks=10_001)  # past w1's KV capacity
    negative = SyncBooking(request_id="neg", worker="w1", tokens=-1)
    bad = RouterSync(router="ra", entries=[], snapshot=SyncSnapshot(seq=1, part=0, parts=1, bookings=[huge, negative]))
    await publish(nc, ns, encode_msg(bad), snapshot(2, 3, 2))
    await until(lambda: b.stats.malformed == 3, what="the bookings and the part refused")
    assert b.view.bookings("w1") == 0
    assert len([r for r in caplog.records if "malformed router sync from router ra" in r.getMessage()]) == 1


async def test_a_booking_its_routers_snapshots_name_does_not_expire(nc: Client, ns: str) -> None:
    """`peer_ttl_s` is the last safety net: a booking its router's snapshots keep naming is live,
    one they do not (here no sweep drops it: each snapshot lacks its second part) expires."""
    clock = Clock()
    b = ReplicaSync(nc, ns, "rb", LoadView(clock=clock), peer_ttl_s=600.0)
    b.view.update(LoadReport(worker="w1", ts=clock.now, kv_total_blocks=10_000))
    b._on_payload(adds("live", "unnamed"))
    for seq in range(3):
        clock.now += 300
        b._on_payload(snapshot(seq, 0, 2, "live"))
        b._expire()
    assert b.view.keys("ra") == {("live", "w1")}
    assert b.stats.bookings_expired == 1


class _RouterSyncBefore20261207(msgspec.Struct, kw_only=True):
    """RouterSync as a router before 2026-12-07 declares it."""

    v: int = 1
    router: str
    entries: list[SyncEntry]


async def test_a_router_that_predates_snapshots_reads_a_message_holding_one(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its RouterSync has no `snapshot`: msgspec skips the field, and the entries apply with no
    word (this test also passes on the code before snapshots, which is what it shows)."""
    caplog.set_level(logging.WARNING, logger="router")
    payload = msgspec.msgpack.encode(
        {
            "v": 1,
            "router": "ra",
            "entries": [{"request_id": "q", "worker": "w1", "kind": "add", "tokens": 8, "blocks": 2}],
            "snapshot": {
                "seq": 1,
                "part": 0,
                "parts": 1,
                "bookings": [{"request_id": "q", "worker": "w1", "tokens": 8, "blocks": 2}],
            },
        }
    )
    old = decode_msg(payload, _RouterSyncBefore20261207)
    assert [e.request_id for e in old.entries] == ["q"]
    b = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0)
    b._on_payload(payload)
    assert b.view.bookings("w1") == 1
    assert b.stats.malformed == 0 and not b.stats.entries_unknown
    assert not caplog.records


@pytest.mark.parametrize("value", ["0", "0.5", "301", "-1", "nan", "inf"])
def test_a_bad_sync_snapshot_period_is_refused_naming_the_flag_and_range(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args("--sync-snapshot-s", value))
    assert "--sync-snapshot-s" in str(err.value) and "[1, 300]" in str(err.value)


def test_the_sync_snapshot_period_reaches_the_router() -> None:
    assert cli.build_config(_args()).sync_snapshot_s == 30.0
    assert cli.build_config(_args("--sync-snapshot-s", "5")).sync_snapshot_s == 5.0
