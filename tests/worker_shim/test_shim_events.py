"""The canonical set end to end: sim block pool -> shim -> NATS subscriber (real nats, etcd, sim)."""

from __future__ import annotations

import asyncio

from engine_sim.server import SimServer
from tests.worker_shim.cluster import (
    complete,
    engine_set,
    follower_of,
    shared_prefix_prompts,
    shim_for,
    sim_config,
    wait_for,
)


async def test_canonical_set_equals_sim_pool_and_subscriber(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(num_gpu_blocks=96)) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        async with shim, follower_of(shim, ns, nats_url) as follower:
            for p in shared_prefix_prompts(60):
                await complete(sim.url, p)
            # The pool is small, so blocks were evicted (Removed) as well as stored.
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim), what="shim == sim pool")
            await wait_for(lambda: follower.hashes == shim.canonical_hashes(), what="subscriber == shim")
            assert any(b for b in follower.batches if any(type(e).__name__ == "Removed" for e in b.events))
            seqs = [b.seq for b in follower.batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


async def _drive(sim: SimServer, prompts: list[list[int]], concurrency: int = 1) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> None:
        async with sem:
            await complete(sim.url, p, max_tokens=1)

    await asyncio.gather(*(one(p) for p in prompts))


async def _dropped_run(ns: str, nats_url: str, etcd_url: str, replay: bool) -> None:
    async with SimServer(sim_config(num_gpu_blocks=128, drop_event_fraction=0.01)) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, **({} if replay else {"kv_replay": None}))
        async with shim:
            await shim.registered.wait()
            # One request at a time: each step is its own event batch, so ~1% of ~1,000 are dropped.
            prompts = shared_prefix_prompts(500, seed=7)
            await _drive(sim, prompts[:100])
            # Joins late: its first batch is not seq 1, so it bootstraps from a kvstate dump.
            async with follower_of(shim, ns, nats_url) as follower:
                await _drive(sim, prompts[100:])
                events = shim.adapter._events  # type: ignore[attr-defined]
                assert events is not None and events.stats.gaps >= 1, "no batch was dropped: the test proved nothing"
                if replay:
                    assert events.stats.replay_failures == 0
                    await wait_for(lambda: shim.canonical_hashes() == engine_set(sim), what="shim == sim pool")
                else:
                    assert shim.normaliser is not None and shim.normaliser.stats.resets >= 2
                await wait_for(lambda: follower.hashes == shim.canonical_hashes(), what="subscriber == shim")
                assert follower.repairs >= 1


async def test_dropped_batches_repaired_by_replay(ns: str, nats_url: str, etcd_url: str) -> None:
    await _dropped_run(ns, nats_url, etcd_url, replay=True)


async def test_dropped_batches_without_replay_clear_and_rebuild(ns: str, nats_url: str, etcd_url: str) -> None:
    await _dropped_run(ns, nats_url, etcd_url, replay=False)
