"""Fault knobs and restart: crash, hang, dropped event batches, a restart that starts seq over."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from engine_sim import KVEventsConfig, ServerStatus, SimServer
from engine_sim.scheduler import StepResult
from tests.engine_sim.conftest import connected_subscriber, decode_payload, replay, sim_config


async def complete(sim: SimServer, base: int, max_tokens: int = 2, timeout: float = 5.0) -> int:
    body = {"prompt": list(range(base, base + 40)), "max_tokens": max_tokens}
    async with (
        aiohttp.ClientSession() as s,
        s.post(sim.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r,
    ):
        await r.read()
        return r.status


async def test_crash_after_n_requests_drops_the_server() -> None:
    async with SimServer(sim_config(crash_after=2)) as sim:
        assert await complete(sim, 1000) == 200
        assert await complete(sim, 2000) == 200
        with pytest.raises(aiohttp.ClientError):
            await complete(sim, 3000)
        await asyncio.wait_for(sim.crashed.wait(), 5)
        assert sim.status is ServerStatus.CRASHED
        with pytest.raises(aiohttp.ClientConnectionError):
            await complete(sim, 4000)
        port = sim.port
        await sim.restart()
        assert sim.port == port and await complete(sim, 5000) == 200


@pytest.mark.parametrize("port", ["0", "*"])
async def test_a_restart_binds_the_event_ports_its_first_start_chose(port: str) -> None:
    # a shim connected to the ports chosen at first bind must find the engine there again
    events = msgspec.structs.replace(
        KVEventsConfig.ephemeral("kv-events"),
        endpoint="tcp://127.0.0.1:*",  # `*`: the PUB binds (vLLM's rule), on a port of its choosing
        replay_endpoint=f"tcp://127.0.0.1:{port}",
    )
    async with SimServer(sim_config(kv_events=events)) as sim:
        first = sim.events_endpoint, sim.replay_endpoint
        assert not any(ep is None or ep.endswith((":0", ":*")) for ep in first)
        await sim.restart()
        assert (sim.events_endpoint, sim.replay_endpoint) == first
        # and it still binds there (a PUB that connected to the port it named would publish to nobody)
        sub = await connected_subscriber(sim)
        try:
            await complete(sim, 1000)
            assert len(await sub.wait_for(1)) == 1
        finally:
            sub.close()


async def test_restart_empties_cache_and_starts_seq_over() -> None:
    async with SimServer(sim_config()) as sim:
        await complete(sim, 1000)
        await complete(sim, 2000)
        old_id, events_ep = sim.engine.engine_id, sim.events_endpoint
        assert sim.event_seq == 2 and sim.engine.cached_block_prefixes()
        await sim.restart()
        assert sim.engine.engine_id != old_id and sim.events_endpoint == events_ep
        assert sim.event_seq == 0 and sim.engine.cached_block_prefixes() == []
        assert sim.replay_endpoint is not None
        assert len(await replay(sim.replay_endpoint, 0)) == 1  # only the end marker
        sub = await connected_subscriber(sim)
        try:
            await complete(sim, 1000)
            (msg,) = await sub.wait_for(1)
        finally:
            sub.close()
        assert int.from_bytes(msg[1], "big") == 0


async def test_hang_stalls_requests_and_resumes() -> None:
    async with SimServer(sim_config(hang_after=1)) as sim:
        assert await complete(sim, 1000) == 200
        task = asyncio.create_task(complete(sim, 2000))
        await asyncio.sleep(0.2)
        assert not task.done() and sim.faults.hang
        async with aiohttp.ClientSession() as s, s.get(sim.url + "/health") as r:
            assert r.status == 200  # a stuck engine still answers liveness probes
        sim.faults.hang = False
        assert await asyncio.wait_for(task, 5) == 200


async def test_dropped_batches_leave_seq_gaps_that_replay_fills() -> None:
    async with SimServer(sim_config(drop_event_fraction=0.5)) as sim:
        sub = await connected_subscriber(sim)
        try:
            for i in range(20):
                await complete(sim, 1000 * (i + 1), max_tokens=1)
            live = await sub.drain()
        finally:
            sub.close()
        assert sim.replay_endpoint is not None
        replayed = await replay(sim.replay_endpoint, 0)
    seqs = [int.from_bytes(m[1], "big") for m in live]
    assert seqs == list(range(0, 20, 2))  # F = 0.5 drops every second batch, evenly
    assert [int.from_bytes(f[2], "big") for f in replayed[:-1]] == list(range(20))
    by_seq = {int.from_bytes(f[2], "big"): f[3] for f in replayed[:-1]}
    assert all(by_seq[int.from_bytes(m[1], "big")] == m[2] for m in live)


async def test_faults_over_http() -> None:
    async with SimServer(sim_config()) as sim, aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/sim/faults", json={"slowdown": 2.5, "drop_event_fraction": 0.1}) as r:
            body = await r.json()
        assert r.status == 200 and body["slowdown"] == 2.5 and sim.faults.drop_event_fraction == 0.1
        async with s.post(sim.url + "/sim/faults", json={"bogus": 1}) as r:
            assert r.status == 400
        async with s.post(sim.url + "/sim/faults", json={"crash": True}) as r:
            assert r.status == 202
        await asyncio.wait_for(sim.crashed.wait(), 5)


async def test_reset_prefix_cache_event_arrives_with_next_step() -> None:
    async with SimServer(sim_config()) as sim:
        await complete(sim, 1000)
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/reset_prefix_cache") as r:
            assert (await r.json()) == {"success": True}
        assert sim.event_seq == 1  # nothing published yet: the engine has not stepped
        await complete(sim, 1000)
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 1)
    types = [e["type"] for e in decode_payload(replies[0][3])[1]]
    assert types[0] == "AllBlocksCleared" and "BlockStored" in types


async def test_stop_is_idempotent_and_leaves_no_tasks() -> None:
    sim = SimServer(sim_config())
    await sim.start()
    await complete(sim, 1000)
    before = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    await sim.stop()
    await sim.stop()
    leftover = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} - before
    assert not leftover and not [t for t in before if not t.done() and "engine" in t.get_name()]
    assert sim.status is ServerStatus.STOPPED


async def test_a_step_loop_that_raises_kills_the_engine_loudly(caplog: pytest.LogCaptureFixture) -> None:
    # It died inside its task: the sim kept answering /health with every request hanging, and the
    # error stayed in the task until stop().
    async with SimServer(sim_config()) as sim:
        assert await complete(sim, 1000) == 200

        def broken() -> StepResult:
            raise RuntimeError("scheduler invariant broken")

        sim.engine.step = broken  # type: ignore[method-assign]
        with pytest.raises(aiohttp.ClientError):
            await complete(sim, 2000)
        await asyncio.wait_for(sim.crashed.wait(), 5)
        assert sim.status is ServerStatus.CRASHED
        said = [r.getMessage() for r in caplog.records]
        assert any("the step loop raised; the engine is dead" in m for m in said), said
        assert any("its step loop raised RuntimeError: scheduler invariant broken" in m for m in said), said
