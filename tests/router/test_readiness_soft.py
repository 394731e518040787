"""/ready agrees with what the planner does: a model whose every decode or agg worker is excluded
softly (`engine_unhealthy`: their engines too loaded to answer the shims' load polls) is served by
them, so the router is ready, and says so in `warnings`. It answered 503 while serving every
request, and with /ready as the readinessProbe every router pod went NotReady under that overload."""

from __future__ import annotations

import aiohttp
import pytest

from protocol.config import EtcdSettings
from router.service import RouterService
from tests.relay import Relay
from tests.router.conftest import MODEL, Cluster, Worker, complete
from tests.router.polling import until
from worker_shim.adapters import EngineError, EngineLoad


def _fail_load_polls(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing() -> EngineLoad:
        raise EngineError(504, "engine_timeout", "the engine did not answer /metrics in time")

    monkeypatch.setattr(worker.shim.adapter, "load", failing)


def _excluded(router: RouterService, worker: Worker) -> str | None:
    (st,) = [s for s in router.worker_listing()["worker_status"] if s["worker"] == worker.id]
    return st["excluded"]  # type: ignore[no-any-return]


async def test_a_model_served_only_by_unhealthy_engines_is_ready_with_a_warning(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    _fail_load_polls(worker, monkeypatch)
    await until(lambda: _excluded(router, worker) == "engine_unhealthy", what="the engine reported failing")
    async with http.get(router.url + "/ready") as r:
        body = await r.json()
        assert r.status == 200, body
    assert body["problems"] == [] and body["routable"] == 0
    assert body["models"][MODEL]["routable_decode"] == 0 and body["models"][MODEL]["soft_decode"] == 1
    (warning,) = body["warnings"]
    assert MODEL in warning and "no decode or agg worker is routable" in warning and "engine_unhealthy" in warning
    status, out, headers = await complete(http, router, list(range(40)))  # what /ready promises
    assert status == 200 and headers["x-kvswitch-decode-worker"] == worker.id, out


async def test_an_unhealthy_engine_beside_a_healthy_one_is_no_warning(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    sick = await cluster.add_worker("agg")
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    _fail_load_polls(sick, monkeypatch)
    await until(lambda: _excluded(router, sick) == "engine_unhealthy", what="the engine reported failing")
    async with http.get(router.url + "/ready") as r:
        body = await r.json()
        assert r.status == 200, body
    assert body["warnings"] == [] and body["models"][MODEL]["routable_decode"] == 1
    assert body["models"][MODEL]["soft_decode"] == 1  # left out while the healthy one serves


async def test_a_router_cut_off_from_a_live_etcd_past_its_lease_ttl_warns_that_workers_will_cancel_its_legs(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg")
    relay = Relay(int(cluster.etcd_url.rsplit(":", 1)[1]))  # etcd up for all, this router cut off
    await relay.start()
    try:
        etcd = EtcdSettings(endpoints=[f"http://127.0.0.1:{relay.port}"])
        router = await cluster.add_router(config={"lease_ttl_s": 2, "etcd": etcd}, disagg="never")
        await cluster.ready(router)
        assert not any("lease" in w for w in router.readiness()[1]["warnings"])
        relay.frozen.set()
        await until(
            lambda: any("etcd has not renewed this router's lease" in w for w in router.readiness()[1]["warnings"]),
            timeout=15,
            what="the warning",
        )
        async with http.get(router.url + "/ready") as r:
            assert r.status == 200  # a warning: with etcd down for all, the fleet routes on
            assert any("--orphan-grace-s" in w for w in (await r.json())["warnings"])
    finally:
        await relay.close()
