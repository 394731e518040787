"""One worker's fault never stops the fleet: a hanging new worker, forged KV batches, a router's
lost lease, overload. Real nats-server, etcd, sims and shims; token-id prompts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

import router.http_api as router_http_api
from discovery import Discovery
from kvswitch.servers import EtcdServer, NatsServer
from protocol import KvEventBatch, Stored, WorkerInfo, encode_msg, subjects
from protocol.config import EtcdSettings
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster, complete
from tests.router.polling import until


async def test_a_registered_worker_that_never_answers_is_left_out_and_the_rest_serve(
    cluster: Cluster, http: aiohttp.ClientSession, etcd_url: str
) -> None:
    alive = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        lease = await d.register_worker(
            lambda wid: WorkerInfo(
                worker=wid, model=MODEL, role="agg", engine="vllm", block_size=16, tokenizer="builtin"
            )
        )
        await until(lambda: router.registry.get(lease.hex_id) is not None, what="the hanging worker registered")
        results = await asyncio.gather(*(complete(http, router, list(range(i, i + 200))) for i in range(0, 4000, 200)))
        assert [s for s, _, _ in results] == [200] * 20
        assert {h["x-kvswitch-decode-worker"] for _, _, h in results} == {alive.id}
        async with http.get(router.url + "/ready") as r:
            assert r.status == 200
            body = await r.json()
        (hung,) = [w for w in body["worker_status"] if w["worker"] == lease.hex_id]
        assert hung["routable"] is False and hung["excluded"] == "bootstrapping"
        assert "failed kvstate requests" in hung["why"] or "first full state" in hung["why"]


async def test_forged_batches_leave_the_others_routable_and_the_worker_recovers(
    cluster: Cluster, http: aiohttp.ClientSession, nc: Client
) -> None:
    target = await cluster.add_worker("agg")
    other = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    status, _, _ = await complete(http, router, list(range(300)))
    assert status == 200
    stats = router.ingest.stats
    synced = router.ingest.stats.workers[target.id]
    await until(lambda: synced.last_seq >= 1, what="a first batch")
    epoch = synced.epoch or 0
    ahead = KvEventBatch(
        worker=target.id, epoch=epoch, seq=synced.last_seq + 1000, ts=time.time(), events=[Stored(hashes=[7])]
    )
    new_epoch = KvEventBatch(worker=target.id, epoch=epoch ^ 1, seq=1, ts=time.time(), events=[])
    for forged in (ahead, new_epoch):
        await nc.publish(subjects.kv(cluster.ns, target.id), encode_msg(forged))
        results = await asyncio.gather(*(complete(http, router, list(range(i, i + 100))) for i in range(0, 1000, 100)))
        assert [s for s, _, _ in results] == [200] * 10  # served throughout, by whichever is routable
        await until(lambda: router.ingest.sync_state(target.id) is None, what="the forged worker repaired")
    assert stats.dropped_impossible == 2
    assert 7 not in router.index.worker_hashes(target.id)
    assert router.ingest.sync_state(other.id) is None
    # The shim's set is read at once and the router's index when the shim's batches arrive (it
    # coalesces them): equal once those in flight are in, with no further repair. (Compared at once,
    # it failed once under CI load, the index empty while the target read as synced.)
    repairs = (stats.repairs_dumps, stats.repairs_batches)
    await until(
        lambda: sorted(router.index.worker_hashes(target.id)) == sorted(target.shim.canonical_hashes()),
        what="the target's index equal to its shim's set",
    )
    seen = (stats.workers[target.id], router.index.digest(target.id))
    assert (stats.repairs_dumps, stats.repairs_batches) == repairs, seen


async def test_a_router_that_lost_its_lease_registers_anew_and_peers_count_its_bookings(
    cluster: Cluster, http: aiohttp.ClientSession, etcd_url: str
) -> None:
    worker = await cluster.add_worker("agg")
    a = await cluster.add_ready_router(disagg="never")
    b = await cluster.add_ready_router(disagg="never")
    old = a.router_id
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        assert d.client.lease is not None
        with contextlib.suppress(grpc.aio.AioRpcError):
            await d.client.lease.revoke(int(old, 16), timeout=5.0)
    await until(lambda: a.reregistrations == 1 and a.router_id != old, what="a new registration")
    await until(lambda: b.sync.registered(a.router_id) is True, what="the peer to see the new key")
    request = asyncio.create_task(complete(http, a, list(range(500)), max_tokens=2000, ignore_eos=True))
    await until(lambda: b.view.bookings(worker.id) == 1, what="a's booking at b")
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)


# Its bound is wall time through real router and sim processes, 40 prompts of 4,096 tokens parsed,
# hashed and planned on the CPU beside the admission's waits: run serially, off a loaded box.
@pytest.mark.timing
async def test_overload_gets_429_with_retry_after_and_admitted_requests_keep_their_ttft(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg", speedup=1.0)  # H200 time: 4,096 tokens prefill in about 0.25 s
    router = await cluster.add_ready_router(disagg="never", slo_ttft_s=1.0)

    async def one(i: int) -> tuple[int, float, str | None]:
        prompt = [(i * 7919 + k) % 30_000 + 1 for k in range(4096)]  # ids inside the sim's vocabulary
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        start = time.monotonic()
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            async for _ in resp.content:
                break
            ttft = time.monotonic() - start
            await resp.read()
            return resp.status, ttft, resp.headers.get("Retry-After")

    results = await asyncio.gather(*(one(i) for i in range(40)))  # ~10 s of prefill at once: 5x what 2 s allows
    refused = [r for r in results if r[0] == 429]
    admitted = [r for r in results if r[0] == 200]
    assert refused and admitted and len(refused) + len(admitted) == 40, sorted({r[0] for r in results})
    assert all(r[2] is not None and int(r[2]) >= 1 for r in refused)
    assert max(t for _, t, _ in admitted) <= 2 * 1.0 + 0.5  # within 2x the SLO (plus this machine's slack)
    assert router.path.admission.refused + router.path.admission.timed_out == len(refused)


async def test_an_etcd_outage_of_15_s_costs_no_request_and_no_worker_id(
    nats_url: str, ns: str, http: aiohttp.ClientSession
) -> None:
    with EtcdServer() as etcd:
        c = Cluster(ns, nats_url, etcd.url)
        try:
            workers = [await c.add_worker("agg") for _ in range(2)]
            ids = {w.id for w in workers}
            router = await c.add_ready_router(disagg="never")
            etcd.stop()
            statuses = []
            until_t = time.monotonic() + 15.0
            i = 0
            while time.monotonic() < until_t:
                status, _, headers = await complete(http, router, list(range(i, i + 100)))
                statuses.append((status, headers.get("x-kvswitch-decode-worker")))
                i += 100
                await asyncio.sleep(0.1)
            await asyncio.get_running_loop().run_in_executor(None, etcd.restart)
            await until(lambda: len(router.registry.workers()) == 2, what="workers")
            assert [s for s, _ in statuses if s != 200] == []
            assert {w for _, w in statuses} <= ids and {w.id for w in workers} == ids  # nobody re-registered
            assert {i.worker for i in router.registry.workers()} == ids
            status, _, _ = await complete(http, router, list(range(5)))
            assert status == 200
        finally:
            await c.close()


async def test_a_client_that_leaves_is_counted_as_499_not_as_a_server_error(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 30000, "stream": True, "ignore_eos": True}
    resp = await http.post(router.url + "/v1/completions", json=body)
    await resp.content.readline()
    resp.close()
    await until(lambda: not worker.sim.engine.running, what="the cancel")

    def count(code: str) -> float:
        for family in text_string_to_metric_families(router.metrics.render().decode()):
            for sample in family.samples:
                if sample.name == "kvswitch_router_requests_total" and sample.labels.get("code") == code:
                    return float(sample.value)
        return 0.0

    await until(lambda: count("499") == 1, what="499 counted")
    assert count("500") == 0


async def test_a_client_reset_met_in_a_write_is_a_client_that_left_not_a_failed_stream(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp raises ClientConnectionResetError from a write once the client's reset closed the
    transport, when that comes before the handler is cancelled: it was logged as a failed stream,
    traceback and all, at ERROR, for a client that left."""
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    caplog.set_level(logging.INFO, logger="router.http_api")
    sent = router_http_api._sent
    writes = 0

    async def reset_on_the_second(request: web.Request, data: bytes, write: Any, deadline: float) -> bool:
        nonlocal writes
        writes += 1
        if writes == 2:  # the client's reset closed the transport: what StreamResponse.write raises then
            assert request.transport is not None
            request.transport.close()
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await sent(request, data, write, deadline)

    monkeypatch.setattr(router_http_api, "_sent", reset_on_the_second)
    body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 30000, "stream": True, "ignore_eos": True}
    with contextlib.suppress(aiohttp.ClientError):
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            await resp.read()
    await until(lambda: not worker.sim.engine.running, what="the cancel")
    await until(
        lambda: (
            router.metrics.registry.get_sample_value(
                "kvswitch_router_requests_total", {"endpoint": "completions", "code": "499"}
            )
            == 1
        ),
        what="499 counted",
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def _unready_because(http: aiohttp.ClientSession, router: RouterService, reason: str) -> None:
    async with http.get(router.url + "/ready") as r:
        assert r.status == 503
        assert any(reason in p for p in (await r.json())["problems"])


async def _ready_and_serving(http: aiohttp.ClientSession, router: RouterService, what: str) -> None:
    await until(lambda: router.ready, timeout=30, what=what)
    status, body, _ = await complete(http, router, list(range(60)))
    assert status == 200, body


@contextlib.asynccontextmanager
async def _one_agg_worker(etcd_url: str, ns: str) -> AsyncIterator[tuple[NatsServer, RouterService]]:
    """A NATS server of the test's own (to stop and start), one agg worker and a ready router."""
    with NatsServer() as nats_server:
        c = Cluster(ns, nats_server.url, etcd_url)
        try:
            await c.add_worker("agg")
            yield nats_server, await c.add_ready_router(disagg="never")
        finally:
            await c.close()


@pytest.mark.parametrize("callback", ["_nats_reconnected", "_nats_disconnected"])
async def test_after_a_nats_outage_ready_waits_for_a_worker_to_report(
    etcd_url: str, ns: str, http: aiohttp.ClientSession, callback: str
) -> None:
    # What nats-py calls once the connection is back: the shims may still be reconnecting, so the
    # router is not ready until one of them reports over the new connection. nats-py reads as
    # connected before it runs that callback (it flushes its buffer in between), so the drop must
    # mark the router too: calling it while the connection reads as up is that window.
    async with _one_agg_worker(etcd_url, ns) as (_, router):
        await getattr(router, callback)()
        await _unready_because(http, router, "no decode or agg worker has reported since")
        await _ready_and_serving(http, router, "ready after the worker's next report")


async def test_ready_is_503_while_nats_is_down_and_200_again_after(
    etcd_url: str, ns: str, http: aiohttp.ClientSession
) -> None:
    async with _one_agg_worker(etcd_url, ns) as (nats_server, router):
        nats_server.stop()
        await until(lambda: not router.ready, what="unready without NATS")
        await _unready_because(http, router, "NATS is not connected")
        status, body, _ = await complete(http, router, list(range(60)))
        assert status == 503 and "lost its NATS connection" in body["error"]["message"], body
        nats_server.start()
        await _ready_and_serving(http, router, "ready again")


async def test_a_draining_worker_gets_no_new_request_while_its_own_finish(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """SIGTERM on a shim (its stop()): its load report says `draining` at once, so routers send new
    requests elsewhere, where each used to cost a refusal (503 draining) and a retry, and a client
    whose retry found a second draining worker (a rolling restart) got the 503."""
    for _ in range(2):
        await cluster.add_worker("agg", shim={"drain_grace_s": 20.0}, speedup=1.0)
    router = await cluster.add_ready_router(disagg="never")
    long = asyncio.create_task(complete(http, router, list(range(64)), max_tokens=400, ignore_eos=True))
    await until(lambda: any(w.shim.requests and w.shim.requests.inflight for w in cluster.workers), what="in flight")
    (leaving,) = [w for w in cluster.workers if w.shim.requests and w.shim.requests.inflight]
    staying = next(w for w in cluster.workers if w is not leaving)
    leaving_id = leaving.id
    stopping = asyncio.create_task(leaving.shim.stop())

    async def excluded() -> str | None:
        async with http.get(router.url + "/ready") as r:
            body = await r.json()
        return next((w["excluded"] for w in body["worker_status"] if w["worker"] == leaving_id), None)

    async with asyncio.timeout(10):
        while await excluded() != "draining":  # noqa: ASYNC110 (polled over HTTP: nothing to wait on)
            await asyncio.sleep(0.01)
    results = await asyncio.gather(*(complete(http, router, list(range(i, i + 64))) for i in range(100, 900, 100)))
    assert [s for s, _, _ in results] == [200] * 8
    assert {h["x-kvswitch-decode-worker"] for _, _, h in results} == {staying.id}
    assert leaving.shim.requests is not None
    assert leaving.shim.requests.outcomes[("agg", "draining")] == 0  # not one was sent there to be refused
    status, body, _ = await long
    assert status == 200 and body["usage"]["completion_tokens"] == 400  # its own request finished
    await stopping
