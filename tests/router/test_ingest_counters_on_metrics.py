"""The KV ingest's drops and repairs are on /metrics (2026-12-06 audit: held batches dropped past
the byte budget, batches of unknown workers, forged ones, duplicates, epoch changes, digest
disagreements and kvstate timeouts were Python attributes only, and an overflow was not logged)."""

from __future__ import annotations

import logging
import time

import aiohttp
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from protocol import KvEventBatch, Stored, encode_msg, subjects
from router.block_index import BlockIndex
from router.ingest_stats import IngestStats
from router.kv_ingest import KvIngest
from router.metrics import RouterMetrics, StateFigures
from runtime.nats_flush import flush
from tests.router.conftest import Cluster
from tests.router.polling import until
from tests.router.test_kv_ingest import FakeShim

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _kv_samples(text: str) -> Samples:
    return {
        (s.name.removeprefix("kvswitch_router_kv_").removesuffix("_total"), frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvswitch_router_kv_")
    }


def _dropped(samples: Samples) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (name, labels), v in samples.items() if name == "dropped"}


def test_every_ingest_count_is_rendered() -> None:
    stats = IngestStats(
        batches_applied=1,
        events_applied=2,
        malformed=3,
        duplicates=4,
        gaps=5,
        epoch_changes=6,
        repairs_batches=7,
        repairs_dumps=8,
        repair_timeouts=9,
        dropped_unknown=10,
        unknown_held=11,
        dropped_overflow=12,
        dropped_impossible=13,
        dropped_stale_session=18,
        digest_mismatches=14,
        digest_lags=15,
        digest_unfixed=16,
        over_budget=17,
        last_lag_s=0.5,
    )
    samples = _kv_samples(RouterMetrics(lambda: StateFigures(ingest=stats)).render().decode())
    plain = {name: v for (name, labels), v in samples.items() if not labels}
    assert plain == {
        "event_lag_seconds": 0.5,
        "batches": 1.0,
        "events": 2.0,
        "malformed": 3.0,
        "duplicates": 4.0,
        "gaps": 5.0,
        "epoch_changes": 6.0,
        "repairs": 15.0,
        "repair_timeouts": 9.0,
        "unknown_held": 11.0,
        "digest_mismatches": 14.0,
        "digest_lags": 15.0,
        "digest_unfixed_workers": 16.0,
        "over_budget": 17.0,
        "disconnects": 0.0,  # the service's, not the ingest's
        "quarantines": 0.0,  # the ingest's subscriptions', not its stats'
        "senders_quarantined": 0.0,
    }
    assert _dropped(samples) == {"unknown": 10.0, "overflow": 12.0, "impossible": 13.0, "stale_session": 18.0}


async def test_held_batches_dropped_past_the_bound_are_on_metrics_and_warned_once_per_repair(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, held_limit=3)
    metrics = RouterMetrics(lambda: StateFigures(ingest=ingest.stats))
    shim = FakeShim(nc, ns, "a1")
    shim.answering = False  # bootstrapping and never answered: everything it sends is held
    await shim.start()
    await ingest.start()
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    try:
        ingest.add_worker(shim.worker, shim.epoch)
        for i in range(10):
            await shim.publish(Stored(hashes=[i + 1]))
        await flush(shim.nc)
        await until(lambda: ingest.stats.dropped_overflow == 9, what="held batches dropped past 3")
        assert _dropped(_kv_samples(metrics.render().decode()))["overflow"] == 9.0
        warned = [r.getMessage() for r in caplog.records if "held KV batches" in r.getMessage()]
        assert len(warned) == 1 and "worker a1: dropped 3 held KV batches" in warned[0], warned
        shim.answering = True
        assert await ingest.wait_synced(10.0)

        shim.answering = False  # a second repair (a gap) that overflows warns again, once
        await shim.publish(Stored(hashes=[100]), drop=True)
        for i in range(5):
            await shim.publish(Stored(hashes=[200 + i]))
        await flush(shim.nc)
        await until(lambda: ingest.stats.dropped_overflow == 12, what="the second repair's batches dropped")
        warned = [r.getMessage() for r in caplog.records if "held KV batches" in r.getMessage()]
        assert len(warned) == 2, warned
        shim.answering = True
        assert await ingest.wait_synced(10.0)
        assert ingest.index.dump() == shim.expected()
    finally:
        shim.answering = True
        await ingest.stop()


async def test_a_routers_kv_drops_duplicates_and_epoch_changes_are_on_its_metrics(
    cluster: Cluster, http: aiohttp.ClientSession, nc: Client
) -> None:
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    synced = router.ingest.stats.workers[worker.id]
    epoch = synced.epoch or 0
    kv = subjects.kv(cluster.ns, worker.id)
    # A batch already applied (seq 0 never is: every seq the shim sends is past it), one of another
    # epoch (forged: the repair it starts shows the shim never sent it), and one of no worker.
    await nc.publish(kv, encode_msg(KvEventBatch(worker=worker.id, epoch=epoch, seq=0, ts=time.time(), events=[])))
    forged = KvEventBatch(worker=worker.id, epoch=epoch ^ 1, seq=1, ts=time.time(), events=[Stored(hashes=[7])])
    await nc.publish(kv, encode_msg(forged))
    ghost = KvEventBatch(worker="ghost", epoch=1, seq=1, ts=time.time(), events=[])
    await nc.publish(subjects.kv(cluster.ns, "ghost"), encode_msg(ghost))
    await flush(nc)
    stats = router.ingest.stats
    await until(lambda: stats.dropped_impossible == 1 and router.ingest.synced, what="the forged batch dropped")
    await until(lambda: stats.unknown_held == 1, what="the ghost's batch held")

    async with http.get(router.url + "/metrics") as r:
        samples = _kv_samples(await r.text())
    assert _dropped(samples) == {"unknown": 0.0, "overflow": 0.0, "impossible": 1.0, "stale_session": 0.0}
    assert (samples["epoch_changes", frozenset()], samples["unknown_held", frozenset()]) == (1.0, 1.0)
    assert samples["duplicates", frozenset()] >= 1.0  # the shim's own held during the repair may add to it
