"""A pool whose shims read each other's KV events (swapped --kv-events / --kv-replay) keeps serving:
each shim publishes a Cleared and none of them (worker_shim.event_owner), the routers' index holds
nothing of either worker, and /ready stays 200 with a warning naming the workers and the fix. Before
2026-12-06 it was silent (the other engine's cache published as each worker's), and the reverted
first attempt excluded both workers (every request a 503). A shim restarted beside a warm engine
without a replay endpoint is not flagged (the audit's reproduction of that attempt's false positive)."""

from __future__ import annotations

import asyncio
import logging
import random

import aiohttp
import msgspec
import pytest

from engine_sim.config import LOOPBACK_PUB_ENDPOINT, KVEventsConfig
from protocol.config import EtcdSettings, NatsSettings
from tests.router.conftest import Cluster, complete
from tests.router.polling import until
from tests.worker_shim.cluster import complete as direct
from worker_shim import WorkerShim
from worker_shim.event_owner import FIX, WINDOW


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(40, 100))] for _ in range(n)]


async def _restart(cluster: Cluster, shim: WorkerShim, **changes: object) -> WorkerShim:
    cfg = msgspec.structs.replace(shim.config, **changes)
    await shim.stop()
    new = WorkerShim(cfg, NatsSettings(servers=[cluster.nats_url]), EtcdSettings(endpoints=[cluster.etcd_url]))
    await new.start()
    await asyncio.wait_for(new.registered.wait(), 20)
    return new


async def test_a_swapped_pool_keeps_serving_without_prefix_credit_and_ready_warns(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    a = await cluster.add_worker("agg", shim={"events_timeout_s": 0.3})
    b = await cluster.add_worker(
        "agg", shim={"events_timeout_s": 0.3, "kv_events": a.sim.events_endpoint, "kv_replay": a.sim.replay_endpoint}
    )
    a.shim = await _restart(cluster, a.shim, kv_events=b.sim.events_endpoint, kv_replay=b.sim.replay_endpoint)
    router = await cluster.add_ready_router()
    with caplog.at_level(logging.ERROR, logger="worker_shim"):
        codes = [(await complete(http, router, p))[0] for p in _prompts(4 * WINDOW, seed=3)]
        await until(lambda: a.shim.owner.foreign and b.shim.owner.foreign, what="both shims find foreign events")
    assert codes == [200] * len(codes)
    assert sum(1 for r in caplog.records if r.levelno == logging.ERROR and FIX in r.getMessage()) == 2

    def warned() -> bool:
        ok, body = router.readiness()
        return ok and any(FIX in w and a.id in w and b.id in w for w in body["warnings"])

    await until(warned, what="/ready warns, and stays ready")
    _, body = router.readiness()
    assert body["routable"] == 2 and not body["problems"]
    await until(lambda: all(router.index_state()[w.id]["blocks"] == 0 for w in (a, b)), what="no foreign entries")
    async with http.get(router.url + "/ready") as resp:
        assert resp.status == 200 and FIX in " ".join((await resp.json())["warnings"])
    after = [(await complete(http, router, p))[0] for p in _prompts(WINDOW, seed=4)]
    assert after == [200] * WINDOW
    assert all(router.index_state()[w.id]["blocks"] == 0 for w in (a, b))


async def test_a_shim_restarted_without_a_replay_endpoint_is_not_foreign(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The engine keeps its cache over the shim's restart and has no replay socket (vLLM's default):
    re-sent prompts are served from a cache the shim's index misses, storing nothing; new ones, and
    requests sent to the engine past the shim, store blocks."""
    ev = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=LOOPBACK_PUB_ENDPOINT.rsplit(":", 1)[0] + ":0",
        replay_endpoint=None,
    )
    w = await cluster.add_worker("agg", shim={"kv_replay": None, "events_timeout_s": 0.3}, kv_events=ev)
    await w.shim.stop()  # the shim restarts (an upgrade); the engine keeps its cache
    old = _prompts(4 * WINDOW, seed=7)
    for p in old:
        await direct(w.sim.url, p)
    w.shim = await _restart(cluster, w.shim)
    router = await cluster.add_ready_router()
    codes = []
    new = _prompts(2 * WINDOW, seed=8)
    past = _prompts(2 * WINDOW, seed=9)
    for i, p in enumerate(old):
        codes.append((await complete(http, router, p))[0])
        await direct(w.sim.url, past[i // 2])
        if i % 4 == 3:
            codes.append((await complete(http, router, new[i // 4]))[0])
    await asyncio.sleep(1.5)
    after = [(await complete(http, router, p))[0] for p in new[WINDOW:]]
    assert codes == [200] * len(codes) and after == [200] * len(after)
    assert w.shim.owner.watched >= 2 * WINDOW and not w.shim.owner.foreign
    ok, body = router.readiness()
    assert ok and not any(FIX in x for x in body["warnings"])
    assert router.index_state()[w.id]["blocks"] > 0
