"""End to end, a shim under a fixed --worker-name (as deploy/k8s sets it) stopping and starting
again on its engine. A stopping shim revokes its lease, then publishes its epoch's last Cleared, so
routers hold that batch as one of a worker with no record. Until 2026-12-07 the next registration
under the name took it over and its bootstrap dropped it as forged: an ERROR on every restart
(the engine-fault audit, 5 of 5). Real nats-server, etcd, sim and shims."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import nats
import pytest

from protocol import subjects
from protocol.config import EtcdSettings, NatsSettings
from protocol.messages import Cleared, KvEventBatch, Stored, encode_msg
from router.service import RouterService
from tests.router.conftest import Cluster, Worker, complete
from tests.router.polling import until
from worker_shim import WorkerShim

NAME = "w-0"
UNKNOWN_TTL_S = 5.0  # KvIngest's unknown_ttl_s, the router's


async def _stopped(worker: Worker, router: RouterService, monkeypatch: pytest.MonkeyPatch) -> int:
    """Until the router has dropped the worker and holds its shim's last batches (the Cleared, and
    any the stop sealed with it), come after the key's delete; how many. In one process they may
    beat the delete to the router; across processes they came after it on each of the audit's
    restarts: each publish waits here until the router has seen the delete."""
    nc = worker.shim.nc
    assert nc is not None
    publish = nc.publish
    subject = subjects.kv(worker.shim.ns, NAME)
    late = 0

    async def after_the_delete(to: str, payload: bytes = b"", **kw: Any) -> None:
        nonlocal late
        if to == subject:
            await until(lambda: router.registry.get(NAME) is None, what="the key's delete seen")
            late += 1
        await publish(to, payload, **kw)

    monkeypatch.setattr(nc, "publish", after_the_delete)
    await worker.shim.stop()
    assert late > 0  # its Cleared at least
    await until(lambda: router.ingest.stats.unknown_held == late, what="its last batches held")
    return late


async def _started_again(cluster: Cluster, worker: Worker, router: RouterService) -> None:
    """A new shim under the name on the same engine, the router synced with it."""
    worker.shim = WorkerShim(
        worker.shim.config, NatsSettings(servers=[cluster.nats_url]), EtcdSettings(endpoints=[cluster.etcd_url])
    )
    await worker.shim.start()
    await until(worker.shim.registered.is_set, what="registered again")
    await until(lambda: router.registry.get(NAME) is not None and router.ingest.synced, what="the router synced")
    await until(
        lambda: sorted(router.index.worker_hashes(NAME)) == sorted(worker.shim.canonical_hashes()),
        what="the index equal to the new shim's set",
    )


async def test_a_shim_back_under_its_worker_name_is_no_forgery(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.ERROR, logger="router.kv_ingest")
    worker = await cluster.add_worker("agg", shim={"worker_name": NAME})
    router = await cluster.add_ready_router(disagg="never")
    status, _, _ = await complete(http, router, list(range(200)))
    assert status == 200
    stats = router.ingest.stats

    held = await _stopped(worker, router, monkeypatch)  # back at once, as a restarted pod or engine is
    await _started_again(cluster, worker, router)
    assert (stats.dropped_stale_session, stats.dropped_unknown, stats.unknown_held) == (held, 0, 0)

    expired = await _stopped(worker, router, monkeypatch)  # back after longer than the router waits for a record
    await asyncio.sleep(UNKNOWN_TTL_S + 0.5)
    await _started_again(cluster, worker, router)
    assert (stats.dropped_stale_session, stats.dropped_unknown, stats.unknown_held) == (held, expired, 0)

    assert stats.dropped_impossible == 0
    assert caplog.records == []
    status, _, headers = await complete(http, router, list(range(200)))
    assert status == 200 and headers["x-kvswitch-decode-worker"] == NAME


async def test_a_forged_batch_held_before_a_new_name_registers_is_an_error(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review of bc70a4c: every batch of another epoch held before its worker registered was
    dropped as an earlier session's, at DEBUG, a forged one too. A ready router has heard the fleet:
    a name that never left has no earlier session, and a batch its shim never sent is an ERROR."""
    caplog.set_level(logging.ERROR, logger="router.kv_ingest")
    await cluster.add_worker("agg", shim={"worker_name": NAME})
    router = await cluster.add_ready_router(disagg="never")
    forger = await nats.connect(cluster.nats_url)
    register = WorkerShim._register

    async def forged_first(shim: WorkerShim) -> str | None:  # held as the key is put, well within the TTL
        if router.ingest.stats.unknown_held == 0:
            forged = KvEventBatch(worker="w-1", epoch=1, seq=1, ts=0.0, events=[Cleared(), Stored(hashes=[66])])
            await forger.publish(subjects.kv(cluster.ns, "w-1"), encode_msg(forged))
            await until(lambda: router.ingest.stats.unknown_held >= 1, what="the forged batch held")
        return await register(shim)

    monkeypatch.setattr(WorkerShim, "_register", forged_first)
    try:
        await cluster.add_worker("agg", shim={"worker_name": "w-1"})
        await until(lambda: router.ingest.stats.dropped_impossible == 1, what="the forged batch judged")
    finally:
        await forger.close()
    assert router.ingest.stats.dropped_stale_session == 0
    assert ["w-1" in r.getMessage() and "never sent" in r.getMessage() for r in caplog.records] == [True]
