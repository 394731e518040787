"""Registration follows engine health; restarts clear and converge (real nats, etcd, sim)."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.errors import FlushTimeoutError

from discovery import Discovery, Put, Snapshot
from engine_sim.server import SimServer
from protocol import KvStateChunk, KvStateRequest, WorkerInfo, decode_msg, encode_msg, subjects
from protocol.config import EtcdSettings
from tests.worker_shim.cluster import (
    complete,
    engine_set,
    follower_of,
    shared_prefix_prompts,
    shim_for,
    sim_config,
    wait_for,
)
from worker_shim import ShimStatus
from worker_shim.shim import WorkerShim


async def registered_workers(etcd_url: str, ns: str) -> set[str]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        async for ev in d.watch_workers():
            assert isinstance(ev, Snapshot)
            return set(ev.items)
    raise AssertionError("no snapshot")


async def test_sim_crash_deregisters_and_restart_reregisters(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        async with shim:
            await shim.registered.wait()
            first = shim.worker_id
            assert first is not None and await registered_workers(etcd_url, ns) == {first}
            async with follower_of(shim, ns, nats_url) as follower:
                for p in shared_prefix_prompts(20):
                    await complete(sim.url, p)
                await wait_for(lambda: follower.hashes == engine_set(sim) != set(), what="converged before crash")

                await sim.crash()
                # worker_id is dropped once the lease is revoked, at the end of the session.
                await wait_for(lambda: not shim.registered.is_set() and shim.worker_id is None, what="deregistered")
                assert await registered_workers(etcd_url, ns) == set()
                await wait_for(lambda: follower.cleared >= 1 and not follower.hashes, what="Cleared published")

            await sim.restart()
            await wait_for(shim.registered.is_set, what="registered again")
            second = shim.worker_id
            assert second is not None and second != first
            assert await registered_workers(etcd_url, ns) == {second}
            for p in shared_prefix_prompts(20, seed=3):
                await complete(sim.url, p)
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), what="converged after restart")
        assert shim.status is ShimStatus.STOPPED
        assert await registered_workers(etcd_url, ns) == set()


async def test_fast_restart_publishes_cleared_and_converges(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim:
        # Health is checked rarely, so only the event sequence going back can reveal the restart.
        shim = shim_for(sim, ns, nats_url, etcd_url, health_interval_s=5.0, health_failures=3)
        async with shim, follower_of(shim, ns, nats_url) as follower:
            for p in shared_prefix_prompts(10):
                await complete(sim.url, p)
            await wait_for(lambda: follower.hashes == engine_set(sim) != set(), what="converged")
            await sim.restart()
            await wait_for(lambda: sim.status.value == "running", what="sim back")
            for p in shared_prefix_prompts(10, seed=5):
                await complete(sim.url, p)
            await wait_for(lambda: follower.cleared >= 1, what="Cleared after the restart")
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim), what="shim == new pool")
            await wait_for(lambda: follower.hashes == shim.canonical_hashes(), what="subscriber == shim")
            assert shim.registered.is_set()


async def test_an_engine_too_busy_to_answer_stays_registered_until_the_busy_limit(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, health_interval_s=0.2, health_failures=2, busy_limit_s=3.5)
        async with shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            worker = shim.worker_id
            sim.faults.health_delay_s = 2.5  # beyond the shim's 2 s probe timeout: busy, not down
            await asyncio.sleep(2.5)  # several late health checks: a loaded engine is not a dead one
            assert shim.registered.is_set() and await registered_workers(etcd_url, ns) == {worker}
            await wait_for(lambda: not shim.registered.is_set(), what="deregistered once busy past the limit")
            sim.faults.health_delay_s = 0.0
            await wait_for(shim.registered.is_set, what="registered again once it answers")


async def test_a_session_that_fails_unexpectedly_is_said_and_a_new_one_starts(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        real = shim._tokenizer
        calls = 0

        async def fails_once() -> str:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise FlushTimeoutError  # what nats-py raises when NATS stalls past a flush's timeout
            return await real()

        shim._tokenizer = fails_once  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
            async with shim:
                await wait_for(shim.registered.is_set, what="registered in the second session")
                assert shim.serving and shim.session_failures == 1 and shim.sessions == 2
                assert await registered_workers(etcd_url, ns) == {shim.worker_id}
            assert shim.status is ShimStatus.STOPPED
        (said,) = [r for r in caplog.records if r.name == "worker_shim.shim"]
        assert "the session with the engine at" in said.getMessage() and "FlushTimeoutError" in said.getMessage()


async def _kvstate_at_first_sight(
    ns: str, nats_url: str, etcd_url: str, timeout: float
) -> tuple[Put[WorkerInfo], KvStateChunk]:
    """A shim's worker record as a watch first shows it, and the answer to a kvstate request sent
    that moment, as a router bootstrapping it sends one."""
    nc = await nats.connect(nats_url)
    try:
        async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            watch = d.watch_workers()
            assert isinstance(await anext(watch), Snapshot)
            async with shim_for(sim, ns, nats_url, etcd_url):
                event = await asyncio.wait_for(anext(watch), 20)
                assert isinstance(event, Put)
                reply = await nc.request(
                    subjects.kvstate(ns, event.name), encode_msg(KvStateRequest()), timeout=timeout
                )
            await watch.aclose()
            return event, decode_msg(reply.data, KvStateChunk)
    finally:
        await nc.close()


async def test_a_worker_answers_on_its_subjects_from_the_moment_its_key_exists(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Subscribing is slowed down, so a key written before the subscriptions shows: a router that
    # reads it at once would find no responder (before 2026-12-03 the key came first).
    opened = WorkerShim._open_presence

    async def slow_open(self: WorkerShim, worker: str) -> object:
        await asyncio.sleep(0.5)
        return await opened(self, worker)

    monkeypatch.setattr(WorkerShim, "_open_presence", slow_open)
    event, chunk = await _kvstate_at_first_sight(ns, nats_url, etcd_url, timeout=5)
    assert chunk.worker == event.name


async def test_a_kvstate_request_the_moment_the_key_exists_is_answered_from_the_epochs_state(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The epoch's KV stream started after the key was written: a router's kvstate request in
    # between got no answer and its repair waited out its timeout (a flake of the test above).
    registered = WorkerShim._on_registered

    async def slow_registered(self: WorkerShim, worker: str) -> None:
        await asyncio.sleep(1.0)
        await registered(self, worker)

    monkeypatch.setattr(WorkerShim, "_on_registered", slow_registered)
    event, chunk = await _kvstate_at_first_sight(ns, nats_url, etcd_url, timeout=0.8)
    assert chunk.worker == event.name and chunk.epoch == event.value.epoch
