"""Replica sync's drops and losses are on /metrics (2026-12-04 audit: they were Python attributes
only, so a stream of forged sync messages or a peer's lost frees could not be seen), and its
traffic (2026-12-06: a replica hearing nothing from peers that route could not be seen either)."""

from __future__ import annotations

import time

import aiohttp
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from discovery import Discovery
from protocol import RouterInfo, subjects
from protocol.config import EtcdSettings
from protocol.messages import RouterSync, SyncEntry, encode_msg
from router.metrics import RouterMetrics, StateFigures
from router.replica_sync import SyncStats
from runtime.nats_flush import flush
from tests.router.conftest import Cluster
from tests.router.polling import until

SYNC = ("malformed", "unregistered", "departed", "send_failures", "peer_bookings_expired", "peers_forgotten")
TRAFFIC = ("messages_sent", "entries_sent", "entries_received")  # until 2026-12-06 read by tests alone
SNAPSHOTS = ("snapshots_sent", "snapshots_taken", "snapshots_incomplete", "too_large")  # from 2026-12-07


def _sync_samples(text: str) -> dict[str, float]:
    return {
        s.name.removeprefix("kvswitch_router_sync_").removesuffix("_total"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvswitch_router_sync_")
    }


def test_every_sync_count_is_rendered() -> None:
    stats = SyncStats(
        malformed=1,
        unregistered=2,
        departed=3,
        send_failures=4,
        bookings_expired=5,
        routers_forgotten=6,
        messages_sent=7,
        entries_sent=8,
        entries_received=9,
        snapshots_sent=10,
        snapshots_taken=11,
        snapshots_incomplete=12,
        too_large=13,
        healed={"added": 14, "dropped": 15, "state": 16},
    )
    text = RouterMetrics(lambda: StateFigures(sync=stats)).render().decode()
    samples = _sync_samples(text)
    healed = samples.pop("snapshot_healed")  # the last of its labels: read whole below
    assert samples == dict(zip(SYNC + TRAFFIC + SNAPSHOTS, [float(n) for n in range(1, 14)], strict=True))
    assert healed == 16.0
    assert {
        s.labels["what"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvswitch_router_sync_snapshot_healed_total"
    } == {"added": 14.0, "dropped": 15.0, "state": 16.0}


async def test_dropped_sync_messages_are_on_metrics(
    cluster: Cluster, http: aiohttp.ClientSession, nc: Client, etcd_url: str
) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    sync = router.sync
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        peer = await d.register_router(
            lambda rid: RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=time.time()), ttl=5
        )
        await until(lambda: sync.registered(peer.hex_id) is True, what="the peer registered")
        await d.release(peer)
        await until(lambda: sync.registered(peer.hex_id) is False, what="the peer's key gone")
    entry = SyncEntry(request_id="x", worker="w", kind="add", blocks=1)
    await nc.publish(subjects.sync(cluster.ns), b"\x93garbage")
    await nc.publish(subjects.sync(cluster.ns), encode_msg(RouterSync(router="forger", entries=[entry])))
    await nc.publish(subjects.sync(cluster.ns), encode_msg(RouterSync(router=peer.hex_id, entries=[entry])))
    await flush(nc)
    await until(lambda: sync.stats.departed == 1, what="the departed peer's message dropped")

    async with http.get(router.url + "/metrics") as r:
        figures = _sync_samples(await r.text())
    assert figures == {
        "malformed": 1.0,
        "unregistered": 1.0,
        "departed": 1.0,
        "send_failures": 0.0,
        "peer_bookings_expired": 0.0,
        "peers_forgotten": 1.0,
        "messages_sent": 0.0,  # no request booked: nothing to tell
        "entries_sent": 0.0,
        "entries_received": 0.0,  # every message dropped before its entries are read
        "snapshots_sent": 0.0,  # its first is 30 s after its start
        "snapshots_taken": 0.0,
        "snapshots_incomplete": 0.0,
        "too_large": 0.0,
        "snapshot_healed": 0.0,  # the last of its labels
    }
