"""/ready is a probe's answer, small and cheap at any fleet size: it counts the workers left out by
reason (`excluded`) and names the first eight of them with why (`worker_status`, as a no-worker 503
does), never a routable one. Until 2026-12-06 it listed every worker: 360 KB at 1,000. The whole
listing is /debug/workers. Real nats-server, etcd, sims and shims; records with no shim behind them
stay `bootstrapping`."""

from __future__ import annotations

import aiohttp

from discovery import Discovery
from protocol import WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until

SHIMLESS = 10  # registered, never bootstrapping: more than /ready names


async def test_ready_names_the_first_workers_left_out_and_counts_them_by_reason_and_never_the_routable(
    cluster: Cluster, http: aiohttp.ClientSession, etcd_url: str
) -> None:
    serving = [await cluster.add_worker("agg") for _ in range(3)]
    router = await cluster.add_ready_router(disagg="never")
    await until(lambda: router.readiness()[1]["routable"] == 3, what="every worker routable")
    prefix = subjects.workers_prefix(cluster.ns)
    shimless = [f"00{i:06x}" for i in range(SHIMLESS)]
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        lease = await d.grant(30)
        for name in shimless:
            info = WorkerInfo(worker=name, model=MODEL, role="agg", engine="vllm", block_size=16, tokenizer="builtin")
            await d.put(subjects.worker_key(cluster.ns, name), encode_json(info), lease)
        await d.put_raw(prefix + "0badbeef", b'{"worker": "0badbeef"}')
        try:
            await until(
                lambda: len(router.registry.workers()) == 3 + SHIMLESS and router.registry.refused >= 1,
                what="the records read",
            )
            async with http.get(router.url + "/ready") as r:
                assert r.status == 200
                body = await r.json()
            assert body["workers"] == 3 + SHIMLESS and body["routable"] == 3, body
            assert body["excluded_by_reason"] == {"bad_record": 1, "bootstrapping": SHIMLESS}, body
            named = body["worker_status"]
            assert len(named) == 8, named  # the rest are counted only
            assert named[0]["worker"] == "0badbeef" and "model" in named[0]["why"]  # a record refused: first
            assert {w["worker"] for w in named[1:]} < set(shimless)
            assert all(not w["routable"] and w["excluded"] == "bootstrapping" and w["why"] for w in named[1:]), named
            assert not {w.id for w in serving} & {w["worker"] for w in named}

            async with http.get(router.url + "/debug/workers") as r:
                assert r.status == 200
                listing = await r.json()
            every = {w["worker"]: w for w in listing["worker_status"]}
            assert set(every) == {*(w.id for w in serving), *shimless, "0badbeef"}
            assert {w for w in every if every[w]["routable"]} == {w.id for w in serving}
            assert every["0badbeef"]["excluded"] == "bad_record"
            assert {every[w]["excluded"] for w in shimless} == {"bootstrapping"}
            assert listing["text_refused"] == []
        finally:
            await d.delete(prefix + "0badbeef")
            await d.release(lease)
