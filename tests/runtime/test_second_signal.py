"""A second SIGTERM to a draining router or shim exits at once with status 130 (runtime.run_service),
but first revokes its etcd lease (its `on_abort`, bounded to about a second): its key goes with the
process, not a TTL later (peers would keep a dead router's bookings, routers list a dead worker)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from etcd3aio import Etcd3Client, prefix_range_end

from discovery import Discovery
from discovery.lease import Lease, LeaseState
from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol import subjects
from protocol.config import EtcdSettings
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until
from worker_shim.shim import WorkerShim

STREAM = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 20_000, "ignore_eos": True, "stream": True}


@pytest.fixture
async def cluster(nats_url: str, etcd_url: str, ns: str) -> AsyncIterator[Cluster]:
    c = Cluster(ns, nats_url, etcd_url)
    try:
        yield c
    finally:
        await c.close()


async def _keys(etcd_url: str, prefix: str) -> list[bytes]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url])) as d:
        assert d.client.kv is not None
        resp = await d.client.kv.get(prefix, prefix_range_end(prefix.encode()), keys_only=True)
        return [kv.key for kv in resp.kvs]


def _spawn(args: list[str], nats_url: str, etcd_url: str, ns: str) -> subprocess.Popen[bytes]:
    connect = ["--namespace", ns, "--nats-servers", nats_url, "--etcd-endpoints", etcd_url]
    return subprocess.Popen(
        [sys.executable, "-m", "kvswitch", *args, *connect], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def _until_ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    async with asyncio.timeout(60):
        while proc.poll() is None:
            try:
                async with http.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"exited with {proc.returncode} before serving")


@pytest.mark.parametrize("cli", ["router", "shim"])
async def test_a_second_sigterm_exits_130_and_the_key_goes_with_the_process(
    cli: str, cluster: Cluster, nats_url: str, etcd_url: str, ns: str
) -> None:
    sim = SimServer(SimConfig(speedup=1.0, num_gpu_blocks=512, block_size=16))  # a stream of minutes
    await sim.start()
    assert sim.events_endpoint is not None
    proc = None
    try:
        async with aiohttp.ClientSession() as http:
            if cli == "router":
                port = free_port()
                proc = _spawn(["router", "--http-port", str(port)], nats_url, etcd_url, ns)
                url, prefix = f"http://127.0.0.1:{port}", subjects.routers_prefix(ns)
                await cluster.add_worker("agg", speedup=1.0)
                await _until_ready(http, url, proc)
            else:
                shim = ["shim", "--engine", "vllm", "--engine-url", sim.url, "--model", sim.config.model,
                        "--kv-events", sim.events_endpoint, "--kv-events-mode", "connect",
                        "--kv-replay", str(sim.replay_endpoint), "--http-port", "0",
                        "--drain-grace-s", "60"]  # fmt: skip
                proc = _spawn(shim, nats_url, etcd_url, ns)
                router = await cluster.add_router()
                url, prefix = router.url, subjects.workers_prefix(ns)
                await until(lambda: router.ready, what="the shim's worker routable", timeout=60)
            assert len(await _keys(etcd_url, prefix)) == 1
            async with http.post(url + "/v1/completions", json=STREAM) as resp:
                assert resp.status == 200
                await resp.content.readline()  # tokens are flowing: the drain waits for them
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, 30)
        assert code == 130
        assert await _keys(etcd_url, prefix) == []  # revoked before the exit, not left for its TTL (10 s)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        await sim.stop()


async def test_an_etcd_that_does_not_answer_holds_the_exit_a_second_at_most(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as hung:  # listens, never answers: a stopped etcd
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        client = Etcd3Client([f"127.0.0.1:{hung.getsockname()[1]}"])
        await client.connect()
        try:
            lease = Lease(client, 0x1234, 10)
            started = time.monotonic()
            lease.revoke_now(timeout=1.0)
            took = time.monotonic() - started
        finally:
            await client.close()
    assert took < 3.0, took  # 1 s and a thread's join; nowhere near the TTL
    assert "lease 1234: revoke failed" in caplog.text and lease.state is LeaseState.ALIVE


@pytest.mark.parametrize("owner", ["router", "shim"])
async def test_a_second_sigterm_while_the_stop_revokes_revokes_the_lease(
    owner: str, cluster: Cluster, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second SIGTERM (revoke_now) while the stop waited on a slow etcd's revoke did nothing: the
    owner had let go of its registration as its stop began (review of 2026-12-08)."""
    real_revoke = Lease._revoke
    revoking, answer = asyncio.Event(), asyncio.Event()

    async def slow(self: Lease, timeout: float) -> BaseException | None:  # a member slow to answer
        revoking.set()
        await answer.wait()
        return await real_revoke(self, timeout)

    if owner == "router":
        service: RouterService | WorkerShim = await cluster.add_router()
        prefix = subjects.routers_prefix(cluster.ns)
    else:
        service = (await cluster.add_worker("agg")).shim
        prefix = subjects.workers_prefix(cluster.ns)
    assert len(await _keys(etcd_url, prefix)) == 1
    monkeypatch.setattr(Lease, "_revoke", slow)
    stopping = asyncio.create_task(service.stop())
    await asyncio.wait_for(revoking.wait(), timeout=30.0)
    try:
        service.revoke_now()  # on the loop's thread, as runtime.run_service's on_abort runs it
        assert await _keys(etcd_url, prefix) == []
    finally:
        answer.set()
        await stopping
