"""A shim restarted after its predecessor was killed without its stop (kill -9) takes the worker
name or engine claim over once the holder is proven gone (worker_shim.takeover): it waited out the
dead shim's lease, 10 s and more with the engine serving nothing (review of 2026-12-06). The proof
is etcd's (the holder's lease missed a renewal) and NATS's (nobody on its cancel subject): a live
holder that NATS alone took for gone (a dropped route in a NATS cluster) was evicted, and so was
one that etcd alone took for gone (its event loop stalled across a renewal, under NATS
credentials). Under NATS credentials, where NATS may not be asked, the lease is waited out. A
holder not proven gone is waited for as before, and a live one is never evicted."""

from __future__ import annotations

import asyncio
import logging
import time

import nats
import pytest
from nats.aio.client import Client as Nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from discovery import Discovery, renewal_interval
from discovery.lease import Lease
from engine_sim.server import SimServer
from kvswitch.servers import NatsServer, free_ports
from protocol import ConfigError, WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings
from runtime.nats_flush import flush
from tests.relay import Relay
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from worker_shim import takeover
from worker_shim.engine_claim import claim
from worker_shim.shim import ShimStatus, WorkerShim

DEAD_TTL = 10  # the dead shim's lease: the default --lease-ttl, which the restarted shim waited out
# From the dead shim's last renewal to the proof: its renewal interval and margin, etcd's whole
# seconds, and the restarted shim's registration (slack for a loaded machine): well under DEAD_TTL.
TAKEN_WITHIN_S = renewal_interval(DEAD_TTL) + takeover.RENEWAL_MARGIN_S + 1 + 1.5


async def _dead_shim(d: Discovery, ns: str, engine_url: str, worker: str, ttl: int = DEAD_TTL) -> Lease:
    """What a shim killed without its stop leaves: its engine claim and worker key under a lease
    nobody renews (last renewed at its grant), and nobody subscribed to its subjects."""
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
        renewed = time.monotonic()
        dead = await _dead_shim(d, ns, sim.url, "deadbeef01")
        async with shim_for(sim, ns, nats_url, etcd_url, lease_ttl=DEAD_TTL) as shim:
            await asyncio.wait_for(shim.registered.wait(), DEAD_TTL)
            assert time.monotonic() - renewed < TAKEN_WITHIN_S and shim.failure is None
            [key] = claim(ns, sim.url, None, "x")
            assert await d.holder(key) == shim.registration.lease.id  # type: ignore[union-attr]
            assert await d.holder(subjects.worker_key(ns, "deadbeef01")) is None, "the dead worker's key went too"
    cancel = subjects.cancel(ns, "deadbeef01")
    assert "which missed its lease renewals for over" in caplog.text
    assert f"NATS has nobody on {cancel}: revoked its lease {dead.id:x}" in caplog.text


async def test_a_killed_shims_worker_name_is_taken_over_without_waiting_out_its_lease(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """A sidecar restarted in its pod (Kubernetes, compose) under the same --worker-name."""
    async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        renewed = time.monotonic()
        await _dead_shim(d, ns, sim.url, "gpu-11")
        async with shim_for(sim, ns, nats_url, etcd_url, worker_name="gpu-11", lease_ttl=DEAD_TTL) as shim:
            await asyncio.wait_for(shim.registered.wait(), DEAD_TTL)
            assert time.monotonic() - renewed < TAKEN_WITHIN_S
            assert shim.worker_id == "gpu-11" and shim.failure is None


async def test_with_nats_credentials_a_killed_shims_lease_is_waited_out(
    ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An identity kvswitch secrets makes may publish on no other worker's subject, nor hear the
    answer, so NATS cannot be asked, and etcd's proof alone also fits a live holder whose event
    loop stalled across a renewal (it was evicted, review of 2026-12-06): under NATS credentials
    even a killed shim's lease is waited out."""
    caplog.set_level(logging.INFO, logger="worker_shim.shim")
    with NatsServer(authorization='authorization { token: "t0k" }') as server:
        async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            granted = time.monotonic()
            await _dead_shim(d, ns, sim.url, "deadbeef03")
            async with shim_for(sim, ns, server.url, etcd_url, lease_ttl=DEAD_TTL, nats_token="t0k") as shim:
                await asyncio.wait_for(shim.registered.wait(), DEAD_TTL + 10)
                assert time.monotonic() - granted >= DEAD_TTL - 1, "registered before the holder's lease expired"
                assert shim.failure is None
    assert "with NATS credentials (--nats-token) NATS is not asked" in caplog.text
    assert "revoked its lease" not in caplog.text


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


async def _answered(nc: Nats, subject: str, answer: type[Exception]) -> None:
    """Wait until a cancel on `subject` from `nc` meets `answer` (the holder's subscription known
    to its server: a timeout; forgotten: no responders)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            await nc.request(subject, b"{}", timeout=0.3)
        except (NoRespondersError, NatsTimeout) as exc:
            if isinstance(exc, answer):
                return
        assert time.monotonic() < deadline, f"{subject} never answered {answer.__name__}"
        await asyncio.sleep(0.1)


def _holds_on(holder: WorkerShim, lease: Lease, newcomer: WorkerShim, caplog: pytest.LogCaptureFixture) -> None:
    """The newcomer waits, and the holder serves on under its own lease."""
    assert not newcomer.registered.is_set() and "revoked its lease" not in caplog.text
    assert holder.failure is None and holder.serving
    assert holder.registration is not None and holder.registration.lease is lease


async def _claimed_by(holder: WorkerShim, lease: Lease, d: Discovery) -> None:
    """The holder's engine claim and worker key are still under `lease`."""
    [key] = claim(holder.ns, holder.config.engine_url, None, "x")
    assert await d.holder(key) == lease.id
    assert await d.holder(subjects.worker_key(holder.ns, holder.worker_id or "")) == lease.id


async def _newcomer_leaves_the_live_holder(
    holder: WorkerShim, newcomer: WorkerShim, d: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    """`newcomer` (the holder's engine, or its --worker-name) sees the holder's lease renewed and
    waits, the holder serving on, its lease and claim its own."""
    assert holder.registration is not None and holder.registration.lease is not None
    lease = holder.registration.lease
    async with newcomer:
        await wait_for(lambda: "renewed within the last" in caplog.text, 20, what="the newcomer's proof to fail")
        _holds_on(holder, lease, newcomer, caplog)
        await _claimed_by(holder, lease, d)


@pytest.mark.parametrize("worker_name", [None, "gpu-21"])
async def test_a_live_holder_that_a_dropped_nats_route_hides_is_not_evicted(
    ns: str, etcd_url: str, worker_name: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A NATS cluster whose route between its two servers drops: each forgets the other's
    subscriptions until the route is back (nats-server retries it after a second or more), so a
    shim on B given the engine (or the --worker-name) of a live shim on A met "no responders" on
    its cancel subject three times, revoked its lease and cut its streams (review of 2026-12-06).
    etcd sees the holder renew its lease: no proof, the newcomer waits."""
    caplog.set_level(logging.INFO, logger="worker_shim.shim")
    port = free_ports(2)
    route = Relay(port)
    await route.start()
    name = {"worker_name": worker_name, "lease_ttl": DEAD_TTL}
    try:
        with (
            NatsServer(cluster_port=port, server_name="A") as a,
            NatsServer(cluster_port=port + 1, routes=[route.port], server_name="B") as b,
        ):
            async with (
                SimServer(sim_config()) as sim,
                Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
                shim_for(sim, ns, a.url, etcd_url, **name) as holder,
            ):
                await asyncio.wait_for(holder.registered.wait(), 20)
                on_b = await nats.connect(b.url)
                try:
                    subject = subjects.cancel(ns, holder.worker_id or "")
                    await _answered(on_b, subject, NatsTimeout)  # B knows the holder's subscription
                    route.accepting = False
                    route.cut()
                    await _answered(on_b, subject, NoRespondersError)  # and forgot it: "gone" to NATS
                    await _newcomer_leaves_the_live_holder(
                        holder, shim_for(sim, ns, b.url, etcd_url, **name), d, caplog
                    )
                finally:
                    await on_b.close()
    finally:
        await route.close()


@pytest.mark.parametrize("credentials", [True, False], ids=["nats-credentials", "no-credentials"])
async def test_a_live_holder_stalled_past_a_renewal_is_not_evicted(
    ns: str, etcd_url: str, credentials: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A live, serving holder whose event loop stalls across a renewal (a long synchronous step):
    under NATS credentials etcd's proof stood alone, and a newcomer for its engine revoked its
    lease, its streams ended with 503 and it exited 2 (review of 2026-12-06, a real 2.5 s stall in
    a process of its own). etcd's side of the stall is the holder's keep-alive paused past the
    point a missed renewal shows; under credentials the newcomer now waits the lease out, and
    without them NATS still has the holder's subscription (a stalled shim answers no cancel)."""
    caplog.set_level(logging.INFO, logger="worker_shim.shim")
    with NatsServer(authorization='authorization { token: "t0k" }' if credentials else None) as server:
        kw = {"lease_ttl": DEAD_TTL} | ({"nats_token": "t0k"} if credentials else {})
        async with (
            SimServer(sim_config()) as sim,
            Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
            shim_for(sim, ns, server.url, etcd_url, **kw) as holder,
        ):
            await asyncio.wait_for(holder.registered.wait(), 20)
            assert holder.registration is not None and holder.registration.lease is not None
            lease = holder.registration.lease
            await lease.stop_keep_alive()  # what etcd sees of the stall: no renewal
            async with shim_for(sim, ns, server.url, etcd_url, **kw) as newcomer:
                # Past the point where the newcomer's proof, had it one, revoked the lease.
                await wait_for(lambda: lease.unrenewed_s > TAKEN_WITHIN_S, 20, what="the stall")
                _holds_on(holder, lease, newcomer, caplog)
                await _claimed_by(holder, lease, d)
                lease.start()  # the loop runs again, within the lease's TTL
            await wait_for(lambda: lease.unrenewed_s < 1, 10, what="a renewal after the stall")
            await _claimed_by(holder, lease, d)
            cancel = subjects.cancel(ns, holder.worker_id or "")
    why = (
        "with NATS credentials (--nats-token) NATS is not asked" if credentials else f"a shim is subscribed on {cancel}"
    )
    assert f"its holder is not proven gone: {why}" in caplog.text
