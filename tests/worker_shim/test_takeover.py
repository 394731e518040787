"""A shim restarted after its predecessor was killed without its stop (kill -9) takes the worker
name or engine claim over at once once the holder is proven gone (worker_shim.takeover): it waited
out the dead shim's lease, 10 s and more with the engine serving nothing (review of 2026-12-06).
A holder not proven gone is waited for as before, and a live one is never evicted."""

from __future__ import annotations

import asyncio
import logging
import time

import nats
import pytest

from discovery import Discovery, KeyTaken
from discovery.lease import Lease
from engine_sim.server import SimServer
from protocol import ConfigError, WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings, NatsSettings
from runtime.nats_flush import flush
from tests.worker_shim.cluster import shim_for, sim_config
from worker_shim import ShimConfig
from worker_shim.engine_claim import claim
from worker_shim.shim import ShimStatus, WorkerShim

DEAD_TTL = 10  # the dead shim's lease: the default --lease-ttl, which the restarted shim waited out


async def _dead_shim(d: Discovery, ns: str, engine_url: str, worker: str, ttl: int = DEAD_TTL) -> Lease:
    """What a shim killed without its stop leaves: its engine claim and worker key under a lease
    nobody renews, and nobody subscribed to its subjects."""
    lease = await d.grant(ttl)
    [(key, value)] = claim(ns, engine_url, None, worker).items()
    await d.create(key, encode_json(value), lease)
    info = WorkerInfo(worker=worker, model="m", role="agg", engine="vllm", block_size=16)
    await d.create(subjects.worker_key(ns, worker), encode_json(info), lease)
    await lease.stop_keep_alive()
    return lease


async def test_a_killed_shims_engine_claim_is_taken_over_without_waiting_out_its_lease(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        dead = await _dead_shim(d, ns, sim.url, "deadbeef01")
        started = time.monotonic()
        async with shim_for(sim, ns, nats_url, etcd_url, lease_ttl=DEAD_TTL) as shim:
            await asyncio.wait_for(shim.registered.wait(), DEAD_TTL / 2)
            assert time.monotonic() - started < DEAD_TTL / 2 and shim.failure is None
            [key] = claim(ns, sim.url, None, "x")
            assert await d.holder(key) == shim.registration.lease.id  # type: ignore[union-attr]
            assert await d.holder(subjects.worker_key(ns, "deadbeef01")) is None, "the dead worker's key went too"
    assert f"revoked its lease {dead.id:x}" in caplog.text


async def test_a_killed_shims_worker_name_is_taken_over_without_waiting_out_its_lease(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """A sidecar restarted in its pod (Kubernetes, compose) under the same --worker-name."""
    async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await _dead_shim(d, ns, sim.url, "gpu-11")
        async with shim_for(sim, ns, nats_url, etcd_url, worker_name="gpu-11", lease_ttl=DEAD_TTL) as shim:
            await asyncio.wait_for(shim.registered.wait(), DEAD_TTL / 2)
            assert shim.worker_id == "gpu-11" and shim.failure is None


@pytest.mark.parametrize("why", ["subscribed", "key under another lease"])
async def test_a_holder_not_proven_gone_is_waited_out(
    ns: str, nats_url: str, etcd_url: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Something on the holder's cancel subject (a live shim, or one whose NATS connection the
    server has not yet seen die), or a worker key the claim's lease does not hold: no proof, so
    the lease is waited out as before."""
    caplog.set_level(logging.INFO, logger="worker_shim.shim")
    nc = await nats.connect(nats_url)
    ttl = 4
    try:
        async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            await _dead_shim(d, ns, sim.url, "deadbeef02", ttl=ttl)
            if why == "subscribed":
                await nc.subscribe(subjects.cancel(ns, "deadbeef02"))  # hears cancels, answers none
                await flush(nc)
            else:
                other = await d.grant(60)
                await d.put(subjects.worker_key(ns, "deadbeef02"), b"{}", other)  # no proof it subscribed
            started = time.monotonic()
            async with shim_for(sim, ns, nats_url, etcd_url, lease_ttl=ttl) as shim:
                await asyncio.wait_for(shim.registered.wait(), 20)
                assert time.monotonic() - started >= ttl - 1, "registered before the holder's lease expired"
            if why != "subscribed":
                await d.release(other)
    finally:
        await nc.close()
    expected = "is subscribed on" if why == "subscribed" else "is not held by lease"
    assert expected in caplog.text and "its holder is not proven gone" in caplog.text


async def test_a_live_holder_revoked_behind_its_back_finds_its_engine_taken_and_exits_2(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """The one holder taken for gone while alive (cut off from NATS for a whole probe): revoked,
    it registers again, meets the new holder's claim and exits 2; never two shims on one engine."""
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
        await asyncio.wait_for(shim.registered.wait(), 20)
        async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            assert shim.registration is not None and shim.registration.lease is not None
            new = await d.grant(30)
            await d.revoke(shim.registration.lease.id)
            [(key, value)] = claim(ns, sim.url, None, "newcomer").items()
            await d.create(key, encode_json(value), new)
            await asyncio.wait_for(shim.done.wait(), 20)
            assert shim.status is ShimStatus.FAILED and isinstance(shim.failure, ConfigError)
            assert shim.failure.setting == "engine_url" and "already served by worker newcomer" in str(shim.failure)
            await d.release(new)


async def test_with_nats_credentials_nothing_is_probed() -> None:
    """An identity kvswitch secrets makes may publish on no other worker's subject, nor hear the
    answer: the holder cannot be proven gone, and its lease is waited out."""
    shim = WorkerShim(
        ShimConfig(engine="vllm", engine_url="http://127.0.0.1:1", model="m"),
        NatsSettings(servers=["nats://127.0.0.1:4222"], token="t"),
        EtcdSettings(endpoints=["http://127.0.0.1:2379"]),
    )
    assert not await shim._took_over(KeyTaken("/ns/workers/w", 7))
