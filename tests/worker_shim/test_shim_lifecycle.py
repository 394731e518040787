"""Registration follows engine health; restarts clear and converge (real nats, etcd, sim)."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from nats.errors import FlushTimeoutError

from discovery import Discovery, Put, Snapshot
from engine_sim.event_publisher import ZmqEventPublisher
from engine_sim.server import SimServer
from protocol import ConfigError, KvStateChunk, KvStateRequest, WorkerInfo, decode_msg, encode_msg, subjects
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


async def registrations(etcd_url: str, ns: str) -> dict[str, WorkerInfo]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        async for ev in d.watch_workers():
            assert isinstance(ev, Snapshot)
            return ev.items
    raise AssertionError("no snapshot")


async def registered_workers(etcd_url: str, ns: str) -> set[str]:
    return set(await registrations(etcd_url, ns))


async def relink(sim: SimServer) -> None:
    """The sim's PUB link drops and comes back while its engine runs on (a network blip): a new PUB
    bound where the old one was, the same seq and replay buffer."""
    publisher = sim._publisher
    assert isinstance(publisher, ZmqEventPublisher) and publisher._pub is not None and sim.events_endpoint
    publisher._pub.close(linger=0)
    pub: zmq.Socket[bytes] = zmq.Context.shadow(zmq.asyncio.Context.instance().underlying).socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    for _ in range(100):  # the closed socket frees its port in ZMQ's I/O thread, a moment later
        try:
            pub.bind(sim.events_endpoint)
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"could not bind {sim.events_endpoint} again")
    publisher._pub = pub


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


async def test_a_fast_restart_ends_the_session_and_registers_anew_with_the_new_limits(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Health is checked rarely, so only the event stream can reveal the restart. Until 2026-12-07
    the shim reset its index and kept its worker id, epoch and record: an engine back with another
    block size, KV capacity or context length was routed on the old run's (its blocks all dropped
    as malformed, prompts past its context sent to it). Now the session ends as on an engine death
    (Cleared, the key revoked) and the worker registers anew, the limits read again."""
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, health_interval_s=5.0, health_failures=3)
        async with shim:
            async with follower_of(shim, ns, nats_url) as follower:
                first, epoch = shim.worker_id, shim.epoch
                for p in shared_prefix_prompts(10):
                    await complete(sim.url, p)
                await wait_for(lambda: follower.hashes == engine_set(sim) != set(), what="converged")
                sim.config = sim.config.replace(block_size=32, num_gpu_blocks=64, max_model_len=1024).validate()
                with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
                    await sim.restart()
                    await wait_for(lambda: shim.registered.is_set() and shim.worker_id != first, what="registered anew")
                assert shim.epoch != epoch and shim.sessions == 2
                await wait_for(lambda: follower.cleared >= 1 and not follower.hashes, what="Cleared on the old id")
            infos, new = await registrations(etcd_url, ns), shim.worker_id
            assert new is not None and set(infos) == {new}
            info = infos[new]
            assert (info.block_size, info.kv_total_blocks, info.max_model_len) == (32, 64, 1024)
            said = [r for r in caplog.records if "restarted" in r.getMessage()]
            assert [r.levelno for r in said] == [logging.WARNING]
            assert sim.url in said[0].getMessage() and "its KV event" in said[0].getMessage()
            async with follower_of(shim, ns, nats_url) as follower:
                for p in shared_prefix_prompts(10, seed=5):
                    await complete(sim.url, p)
                await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), what="shim == new pool")
                await wait_for(lambda: follower.hashes == shim.canonical_hashes(), what="subscriber == shim")


async def test_a_reconnect_to_the_same_engine_run_keeps_the_session(ns: str, nats_url: str, etcd_url: str) -> None:
    """A link that drops and comes back to the same engine run (the replay holds the last seq the
    shim delivered, with the payload it received) is no restart: same id, epoch and session."""
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        async with shim, follower_of(shim, ns, nats_url) as follower:
            first, epoch = shim.worker_id, shim.epoch
            for p in shared_prefix_prompts(10):
                await complete(sim.url, p)
            await wait_for(lambda: follower.hashes == engine_set(sim) != set(), what="converged")
            cleared = follower.cleared
            await relink(sim)
            stats = shim.adapter.event_stats()
            await wait_for(lambda: shim.adapter.event_stats()["reconnects"] == stats["reconnects"] + 1, what="relinked")
            for p in shared_prefix_prompts(10, seed=5):
                await complete(sim.url, p)
            await wait_for(lambda: follower.hashes == engine_set(sim), what="converged after the blip")
            assert (shim.worker_id, shim.epoch, shim.sessions, shim.registered.is_set()) == (first, epoch, 1, True)
            assert shim.adapter.event_stats()["restarts"] == 0 and follower.cleared == cleared


@pytest.mark.parametrize("changed", [False, True], ids=["same-limits", "shorter-context"])
async def test_a_reconnect_before_any_batch_keeps_the_session_unless_the_engine_limits_changed(
    changed: bool, ns: str, nats_url: str, etcd_url: str
) -> None:
    """An engine that has published nothing yet (an idle SGLang engine: it has no endpoint probe;
    here vLLM's sim with --no-endpoint-probe), replay on: until 2026-12-07 any reconnection ended the
    session, as nothing delivered proved the run goes on. The shim holds nothing of it to lose, so
    the engine's limits are read again: the same, the session goes on; another context length (an
    engine restarted with other limits), it ends and the worker registers anew with them."""
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, no_endpoint_probe=True)
        async with shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            first, epoch = shim.worker_id, shim.epoch
            await asyncio.sleep(1.5)  # past the connection's settle probe: nothing published
            assert shim.adapter.event_stats()["messages"] == 0
            if changed:
                sim.config.max_model_len = 512
            await relink(sim)
            await wait_for(lambda: shim.adapter.event_stats()["reconnects"] == 1, what="relinked")
            if not changed:
                await asyncio.sleep(1.0)
                assert (shim.worker_id, shim.epoch, shim.sessions, shim.registered.is_set()) == (first, epoch, 1, True)
                assert shim.adapter.event_stats()["restarts"] == 0
                for p in shared_prefix_prompts(3):
                    await complete(sim.url, p)
                await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), what="shim == engine")
                return
            await wait_for(lambda: shim.sessions == 2 and shim.registered.is_set(), what="registered anew")
            assert shim.worker_id != first and shim.limits.max_model_len == 512
            assert shim.adapter.event_stats()["restarts"] == 1


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


async def test_a_stop_ends_its_log_saying_the_worker_deregistered(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 a shim's log ended at "SIGTERM: draining": whether it left the routers' view
    (its lease revoked) went unsaid."""
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        async with shim:
            await wait_for(shim.registered.is_set, what="registered")
            worker = shim.worker_id
        last = [r for r in caplog.records if r.name == "worker_shim.shim"][-1]
        assert (last.levelname, last.getMessage()) == (
            "INFO",
            f"worker {worker} deregistered (lease {worker} revoked), stopped (no leg in flight)",
        )
        assert await registered_workers(etcd_url, ns) == set()


async def test_a_shim_given_the_engines_openai_base_url_exits_naming_engine_url_and_the_one_that_answers(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """The operator walkthrough's --engine-url http://127.0.0.1:8000/v1: the shim waited for good,
    saying at INFO that the engine's /health was down, where /v1/health answered 404."""
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=sim.url + "/v1")
        async with shim:
            await wait_for(shim.done.is_set, 10, "the shim gives up")
    assert shim.status is ShimStatus.FAILED and isinstance(shim.failure, ConfigError), shim.failure
    assert shim.failure.setting == "engine_url" and shim.failure.value == sim.url + "/v1"
    assert f"{sim.url}/health answers 200: give --engine-url {sim.url}" in str(shim.failure)
    assert shim.registration_count == 0


async def test_a_404_where_the_engine_was_up_is_waited_out_as_an_engine_down(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """Once the engine's /health said up, its URL is right: a server that answers 404 there later
    (another one in the dead engine's port) is no wrong --engine-url, and the shim waits."""
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, health_failures=1)
        async with shim:
            await wait_for(shim.registered.is_set, 20, "registered")
            await sim.crash()
            runner = web.AppRunner(web.Application())  # nothing routed: every path a 404
            await runner.setup()
            try:
                await web.TCPSite(runner, "127.0.0.1", sim.port).start()
                await wait_for(lambda: shim.status is ShimStatus.WAITING_ENGINE, 10, "deregistered")
                await asyncio.sleep(1.0)  # ten health checks
                assert not shim.done.is_set() and shim.failure is None
            finally:
                await runner.cleanup()
