"""The shim fails loudly when KV events do not reach it: no peer on the event socket, a wrong topic,
or a served request followed by no Stored event (real sockets, nats, etcd, sim)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import pytest

from discovery import Discovery
from engine_sim.config import KVEventsConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol import LoadReport, WorkerInfo, decode_json, decode_msg, subjects
from protocol.config import EtcdSettings
from tests.worker_shim.cluster import collector, connect, engine_set, shim_for, sim_config, wait_for
from tests.worker_shim.test_request_service import Collector, gen
from tests.worker_shim.test_zmq_events import StandIn
from worker_shim import EngineBatch
from worker_shim.adapters.zmq_events import ZmqEventSource
from worker_shim.event_health import EventHealth, EventProblem
from worker_shim.shim import WorkerShim

# --- EventHealth alone -------------------------------------------------------------------------------


async def test_a_served_request_without_stored_turns_events_bad_until_events_flow() -> None:
    health = EventHealth(timeout_s=0.2)
    changes: list[bool] = []
    health.on_change = lambda: changes.append(health.ok)
    health.expect_stored(123, "r1", 2)
    await asyncio.sleep(0.3)
    # One timeout in: the transport is asked to read the replay socket, nothing is reported yet.
    assert health.ok and health.silent.is_set() and changes == []
    await asyncio.sleep(0.2)
    assert not health.ok and EventProblem.NO_STORED in health.problems and health.silent.is_set()
    assert "r1" in health.why and "0.4s" in health.why
    health.live(stored=True)
    assert health.ok and not health.silent.is_set() and changes == [False, True]


async def test_a_stored_event_or_a_held_block_satisfies_the_expectation() -> None:
    health = EventHealth(timeout_s=0.1)
    health.expect_stored(1, "flowed", 1)
    health.live(stored=True)
    await asyncio.sleep(0.15)
    assert not health.silent.is_set()
    health.holds = lambda h: h == 2  # already cached: the engine had no reason to store it again
    health.expect_stored(2, "cached", 1)
    await asyncio.sleep(0.15)
    assert health.ok and health.reported == 0 and not health.silent.is_set()
    health.expect_stored(3, "missing", 1)
    health.expect_stored(4, "watched-by-the-first", 1)  # one watch at a time
    await asyncio.sleep(0.3)
    assert not health.ok and health.reported == 1 and "missing" in health.why
    health.close()


async def test_a_stored_event_late_past_one_timeout_is_no_problem() -> None:
    """A loaded host can deliver a live batch after the timeout: the shim looks at the replay
    socket and waits a second window before it reports the worker's events lost."""
    health = EventHealth(timeout_s=0.2)
    health.expect_stored(7, "late", 1)
    await asyncio.sleep(0.3)
    assert health.silent.is_set()
    health.live(stored=True)
    await asyncio.sleep(0.2)
    assert health.ok and health.reported == 0 and not health.silent.is_set()
    health.expect_stored(8, "from-replay", 1)
    await asyncio.sleep(0.3)
    health.holds = lambda h: h == 8  # what the replay socket delivered
    await asyncio.sleep(0.2)
    assert health.ok and health.reported == 0 and not health.silent.is_set()


# --- the ZMQ transport ---------------------------------------------------------------------------------


async def _run(source: ZmqEventSource) -> asyncio.Task[None]:
    batches: list[EngineBatch] = []
    live = asyncio.Event()
    task = asyncio.create_task(source.run(collector(batches), live))
    await asyncio.wait_for(live.wait(), 5)
    return task


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def test_a_bound_socket_no_engine_connects_to_is_reported_then_resolved() -> None:
    stand_in = StandIn("bs32", pub_binds=False)  # the engine connects, so the shim binds
    health = EventHealth(timeout_s=0.4)
    source = ZmqEventSource(
        "vllm", stand_in.shim_endpoint, "auto", "kv-events", stand_in.replay_endpoint, "127.0.0.1", health=health
    )
    replay = asyncio.create_task(stand_in.serve_replay())
    run = await _run(source)
    try:
        await wait_for(lambda: EventProblem.NO_CONNECTION in health.problems, 3, "no-connection reported")
        why = health.problems[EventProblem.NO_CONNECTION]
        assert "bound at" in why and "engine CONNECT" in why and "`*`" in why
        stand_in.connect_pub()
        await wait_for(lambda: health.ok, 3, "resolved once the engine connects")
    finally:
        await _cancel(run, replay)
        stand_in.close()


async def test_connecting_to_a_port_nobody_binds_is_reported_with_the_rule() -> None:
    stand_in = StandIn("bs32", pub_binds=True)
    health = EventHealth(timeout_s=0.4)
    wrong = f"tcp://*:{free_port()}"  # `*`: the shim connects to the engine host, where nothing listens
    source = ZmqEventSource("vllm", wrong, "auto", "kv-events", stand_in.replay_endpoint, "127.0.0.1", health=health)
    replay = asyncio.create_task(stand_in.serve_replay())
    run = await _run(source)
    try:
        await wait_for(lambda: EventProblem.NO_CONNECTION in health.problems, 3, "no-connection reported")
        assert "found no engine at tcp://127.0.0.1:" in health.why and "engine BIND" in health.why
    finally:
        await _cancel(run, replay)
        stand_in.close()


async def test_another_data_parallel_ranks_events_are_reported_and_dropped() -> None:
    """vLLM 0.32's own batches name rank 0: a shim serving rank 1 must not index them, since its
    requests go to rank 1's cache."""
    stand_in = StandIn("bs32", pub_binds=True)
    stand_in.sent.extend(stand_in.frames[:3])
    health = EventHealth(timeout_s=5)
    batches: list[EngineBatch] = []
    source = ZmqEventSource(
        "vllm", stand_in.shim_endpoint, "auto", "kv-events", stand_in.replay_endpoint, "127.0.0.1",
        health=health, rank=1,
    )  # fmt: skip
    replay = asyncio.create_task(stand_in.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(source.run(collector(batches), live))
    try:
        await wait_for(lambda: EventProblem.WRONG_RANK in health.problems, 5, "wrong rank reported")
        assert "data-parallel rank 0, but this shim serves rank 1" in health.why
        assert "--data-parallel-rank 0" in health.why
        assert source.stats.other_rank == 3 and not [b for b in batches if b.events]
    finally:
        await _cancel(run, replay)
        stand_in.close()


async def test_the_replay_socket_names_the_engines_real_topic() -> None:
    stand_in = StandIn("bs32", pub_binds=True)
    stand_in.sent.extend(stand_in.frames[:3])  # the engine published under "kv-events" already
    health = EventHealth(timeout_s=5)
    source = ZmqEventSource(
        "vllm", stand_in.shim_endpoint, "auto", "kv-evts", stand_in.replay_endpoint, "127.0.0.1", health=health
    )
    replay = asyncio.create_task(stand_in.serve_replay())
    run = await _run(source)
    try:
        assert EventProblem.WRONG_TOPIC in health.problems
        assert "'kv-events'" in health.why and "--kv-events-topic kv-events" in health.why
        assert source.stats.other_topic == 3
    finally:
        await _cancel(run, replay)
        stand_in.close()


# --- the whole shim ------------------------------------------------------------------------------------


async def _worker_info(etcd_url: str, ns: str, worker: str) -> WorkerInfo | None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        assert d.client.kv is not None
        resp = await d.client.kv.get(subjects.worker_key(ns, worker), timeout=5)
        return decode_json(resp.kvs[0].value, WorkerInfo) if resp.kvs else None


async def _reported_bad(shim: WorkerShim, ns: str, nats_url: str, etcd_url: str, within: float) -> LoadReport:
    """Waits until etcd and a load report both say events_ok false; returns that report."""
    assert shim.worker_id is not None
    deadline = time.monotonic() + within
    nc = await connect(nats_url)
    reports: list[LoadReport] = []

    async def on(msg: Any) -> None:
        reports.append(decode_msg(msg.data, LoadReport))

    await nc.subscribe(subjects.load(ns, shim.worker_id), cb=on)
    try:
        while True:
            info = await _worker_info(etcd_url, ns, shim.worker_id)
            bad = [r for r in reports if not r.events_ok]
            if info is not None and not info.events_ok and bad:
                return bad[0]
            assert time.monotonic() < deadline, f"not reported within {within}s: {info}, {reports[-1:]}"
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def test_a_wrong_event_port_is_reported_within_ten_seconds(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=f"tcp://127.0.0.1:{free_port()}")
        async with shim:
            started = time.monotonic()
            await shim.registered.wait()
            await _reported_bad(shim, ns, nats_url, etcd_url, within=10 - (time.monotonic() - started))
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "KV event socket" in r.getMessage()]
        assert errors and "engine BIND" in errors[0].getMessage()


async def test_a_wrong_topic_is_reported_within_ten_seconds_naming_the_real_one(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimServer(sim_config(kv_events=KVEventsConfig.ephemeral(topic="kv-events"))) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events_topic="vllm-events")
        async with shim:
            await shim.registered.wait()
            assert shim.worker_id is not None and shim.events.ok
            nc = await connect(nats_url)
            col = Collector(nc)
            await col.start()
            started = time.monotonic()
            await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("r1", list(range(1, 65)), max_tokens=2))
            assert (await col.final("r1")).error is None
            await nc.close()
            await _reported_bad(shim, ns, nats_url, etcd_url, within=10 - (time.monotonic() - started))
            await wait_for(lambda: EventProblem.WRONG_TOPIC in shim.events.problems, 3, "the topic named")
        said = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        # Which look finds it first varies: the replay a settled connection makes (zmq_events.SETTLE_S)
        # once r1's batches are out, or r1's missing Stored; the latter's naming of the request is
        # EventHealth's own test above.
        assert "'kv-events'" in said and "--kv-events-topic kv-events" in said


async def test_live_batches_lost_on_the_wire_are_read_from_replay_before_events_are_judged_lost(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every live batch lost (each stays in the engine's replay buffer): the served request's
    blocks come from the replay socket within the second window, so the worker is not reported
    as publishing no events; the WARNING names the seqs the live socket never delivered."""
    async with SimServer(sim_config(drop_event_fraction=1.0)) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, events_timeout_s=0.3)
        async with shim:
            await shim.registered.wait()
            assert shim.worker_id is not None
            nc = await connect(nats_url)
            col = Collector(nc)
            await col.start()
            await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("r1", list(range(1, 65)), max_tokens=2))
            assert (await col.final("r1")).error is None
            await nc.close()
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), 3, "blocks from replay")
            await asyncio.sleep(0.6)  # past the second window
            assert shim.events.ok and shim.events.reported == 0
        said = [r.getMessage() for r in caplog.records if "never delivered" in r.getMessage()]
        assert said and "after a served request looked unannounced" in said[0]


async def test_an_engine_without_prefix_caching_is_said_once_not_taken_for_lost_events(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM with --no-enable-prefix-caching publishes no KV events at all (checked on 0.32): the
    shim says so at startup and registers the worker as one that caches nothing, and a served
    request that stores nothing is no sign of lost events."""
    async with SimServer(sim_config(enable_prefix_caching=False)) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, events_timeout_s=0.3)
        async with shim:
            await shim.registered.wait()
            assert shim.worker_id is not None
            info = await _worker_info(etcd_url, ns, shim.worker_id)
            assert info is not None and info.prefix_caching is False and info.events_ok
            nc = await connect(nats_url)
            col = Collector(nc)
            await col.start()
            for rid in ("r1", "r2"):
                await col.send(subjects.gen(ns, "agg", shim.worker_id), gen(rid, list(range(1, 65)), max_tokens=2))
                assert (await col.final(rid)).error is None
            await nc.close()
            await asyncio.sleep(0.6)  # twice the events timeout
            assert shim.events.ok and shim.canonical_hashes() == set() and sim.engine.stats.prefix_cache_hits == 0
        said = [r.getMessage() for r in caplog.records if "without prefix caching" in r.getMessage()]
        assert len(said) == 1 and r"--no-enable-prefix-caching" in said[0]
