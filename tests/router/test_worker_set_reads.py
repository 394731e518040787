"""The worker set is read from etcd whatever lies under its prefix, and /ready names a read (of it,
or of the live config) that keeps failing. Audit of 2026-12-07 (etcd 3.4): three 1.4 MB values
under /{ns}/workers/ made the read larger than gRPC's 4 MiB, and a new router never became ready,
/ready saying only that the set "has not been read from etcd yet" while its log repeated a 5-line
WARNING every 0.5 s."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from etcd3aio.kv import KVService

from discovery import Discovery
from protocol import subjects
from protocol.config import EtcdSettings
from tests.router.conftest import Cluster
from tests.router.polling import until


async def test_a_router_reads_workers_past_megabytes_of_values_and_refuses_those(
    cluster: Cluster, etcd_url: str
) -> None:
    worker = await cluster.add_worker("agg")
    prefix = subjects.workers_prefix(cluster.ns)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        lease = await d.grant(30)
        big = [f"big{i}" for i in range(3)]
        for name in big:
            await d.put(prefix + name, b"x" * 1_400_000, lease)
        try:
            router = await cluster.add_router()
            await until(lambda: router.readiness()[0], timeout=20, what="the router ready")
            body = router.readiness()[1]
            assert body["routable"] == 1 and body["excluded_by_reason"] == {"bad_record": 3}, body
            assert {r.name for r in router.registry.refusing()} == set(big)
            assert [i.worker for i in router.registry.workers()] == [worker.id]
        finally:
            await d.release(lease)


async def test_ready_names_a_read_of_the_worker_set_that_keeps_failing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await cluster.add_worker("agg")
    prefix = subjects.workers_prefix(cluster.ns)
    failing = True
    get = KVService.get

    async def refused(self: KVService, key: Any, *args: Any, **kw: Any) -> Any:
        if failing and key in (prefix, prefix.encode()):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="etcd refuses"
            )
        return await get(self, key, *args, **kw)

    monkeypatch.setattr(KVService, "get", refused)
    monkeypatch.setattr("discovery.watch.STALL_S", 0.3, raising=False)  # raising: the old code had none
    caplog.set_level(logging.WARNING, logger="discovery.watch")
    router = await cluster.add_router()

    def named() -> bool:
        return any("reading it from etcd has failed for" in p for p in router.readiness()[1]["problems"])

    await until(named, timeout=10, what="/ready naming the failing read")
    [problem] = [p for p in router.readiness()[1]["problems"] if "etcd" in p]
    assert problem.startswith("the worker set has not been read from etcd yet: reading it from etcd has failed for")
    assert problem.endswith("(RESOURCE_EXHAUSTED: etcd refuses)"), problem
    failing = False
    await until(lambda: router.readiness()[0], timeout=10, what="the router ready once the read works")
    said = [r.getMessage() for r in caplog.records if prefix in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said  # once for the episode, in one line


async def test_ready_warns_of_a_live_config_read_that_keeps_failing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.add_worker("agg")
    key = subjects.config_key(cluster.ns)
    failing = True
    get = KVService.get

    async def refused(self: KVService, at: Any, *args: Any, **kw: Any) -> Any:
        if failing and at in (key, key.encode()):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="etcd refuses"
            )
        return await get(self, at, *args, **kw)

    monkeypatch.setattr(KVService, "get", refused)
    monkeypatch.setattr("discovery.watch.STALL_S", 0.3, raising=False)
    router = await cluster.add_ready_router()

    def warned() -> list[str]:
        return [w for w in router.readiness()[1]["warnings"] if w.startswith(f"the live config at {key}")]

    await until(lambda: bool(warned()), timeout=10, what="/ready warning of the unread live config")
    assert "reading it from etcd has failed for" in warned()[0] and "(UNAVAILABLE: etcd refuses)" in warned()[0]
    assert router.readiness()[0]  # the flags' settings serve: ready
    failing = False
    await until(lambda: not warned(), timeout=10, what="the warning gone once the read works")
